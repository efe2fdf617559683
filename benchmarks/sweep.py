"""Time fa4tune configs over a small grid of knob values on a few shapes; print one table per shape.

    python benchmarks/sweep.py --shape 128:1024:causal --shape 64:4096 \
        --vary tile_n=112,128,144 --vary rescale_threshold=0,8 [--json out.json]

A shape is head_dim:seqlen[:causal][:gN] with 16k tokens and hidden 2048 (as
benchmarks/attention.py).
Each --vary knob=v1,v2 is swept one knob at a time around the default config (not the cross
product), so the table shows what each knob does on its own. Configs the feasibility rules refuse
are listed with their reason, not run. Every config is checked against the fp32 reference first
(fa4tune.kernels.common.verify); a wrong one is listed as such and not timed.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_value(text: str):
    if text in ("true", "false", "True", "False"):
        return text.lower() == "true"
    value = float(text)
    return int(value) if value.is_integer() and "." not in text else value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", required=True)
    ap.add_argument("--vary", action="append", default=[])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from benchmarks.attention import parse_shape
    from fa4tune.kernels.common.verify import TOLERANCES, compare, reference_slices
    from fa4tune.kernels.fa4_fwd_sm90 import FAMILY
    from fa4tune.kernels.fa4_fwd_sm90.compile import compile_forward
    from fa4tune.kernels.fa4_fwd_sm90.config import KNOBS
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward
    from fa4tune.measure.timing import L2Flusher, time_cuda
    from fa4tune.target import get_target

    target = get_target(None)
    flusher = L2Flusher()
    results = []
    for spec in args.shape:
        p = parse_shape(spec)
        d, s, causal = p.head_dim, p.seqlen_q, p.causal
        base = FAMILY.default_config(p, target)
        configs = [base]
        for vary in args.vary:
            knob, values = vary.split("=")
            if knob not in KNOBS:
                raise SystemExit(f"unknown knob {knob}; known: {', '.join(KNOBS)}")
            for v in values.split(","):
                cfg = replace(base, **{knob: parse_value(v)})
                if cfg not in configs:
                    configs.append(cfg)
        q, k, v = (
            torch.randn(p.batch, s, p.nheads_q, d, device="cuda", dtype=torch.bfloat16)
            for _ in range(3)
        )
        references = reference_slices(q, k, v, causal, None)
        print(f"\n## d={d} seqlen={s} causal={causal} batch={p.batch} heads={p.nheads_q}\n")
        print("| config | TFLOP/s | ms | spread | error | compile s |")
        print("|---|---|---|---|---|---|")
        for cfg in configs:
            row = dict(shape=spec, config=cfg.to_dict())
            reasons = FAMILY.infeasible_reasons(p, cfg, target)
            if reasons:
                row["infeasible"] = reasons
                print(f"| {cfg.short()} | infeasible | | | {reasons[0][:60]} | |")
                results.append(row)
                continue
            compiled = compile_forward(cfg, "bf16", d, d, causal, target)
            out = torch.full_like(q, float("nan"))
            lse = torch.full(
                (p.batch, p.nheads_q, s), float("nan"), device="cuda", dtype=torch.float32
            )
            fn = functools.partial(attention_forward, q, k, v, cfg, causal=causal, out=out, lse=lse)
            fn()
            check = compare(out, lse, references)
            err = check.out_error
            wrong = check.verdict(TOLERANCES[p.dtype])
            if wrong:
                row.update(wrong=wrong, error=err)
                results.append(row)
                print(f"| {cfg.short()} | wrong | | | {wrong[:60]} | |")
                continue
            t = time_cuda(fn, flusher=flusher)
            tflops = p.flops / (t.median_ms * 1e-3) / 1e12
            row.update(
                tflops=tflops,
                ms=t.median_ms,
                spread=t.spread,
                error=err,
                compile_s=compiled.compile_seconds,
            )
            results.append(row)
            print(
                f"| {cfg.short()} | {tflops:.1f} | {t.median_ms:.4f} | "
                f"{t.spread:.3f} | {err:.2e} | "
                f"{compiled.compile_seconds:.1f} |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
