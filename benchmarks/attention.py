"""Forward attention TFLOP/s on the standard grid: \
fa4tune (default or given config) against torch SDPA
(cuDNN and flash backends) and flash-attn-4 when installed. Prints a markdown table, writes JSON.

    python benchmarks/attention.py [--json out.json] [--hdims 64,128] [--seqlens 1024,4096,16384]

Grid: 16k tokens per batch, hidden 2048 (nheads = 2048 / head_dim), bf16, causal and not.
FLOPs = 4·b·h·s_q·s_k·d, halved for causal. Every column is checked against the fp32 reference on
slices (fa4tune.kernels.common.verify, LSE too for fa4tune) before it is timed; a column that fails
shows 'wrong'.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


TOKENS, HIDDEN = 16384, 2048


def grid_problem(head_dim: int, seqlen: int, causal: bool, group: int = 1):
    """The design notes' benchmark shape: 16k tokens per batch, hidden 2048, bf16,
    self-attention; `group` query heads per K/V head."""
    from fa4tune.problem import Problem

    nheads_q = HIDDEN // head_dim
    return Problem(
        head_dim=head_dim,
        causal=causal,
        seqlen_q=seqlen,
        seqlen_k=seqlen,
        batch=max(1, TOKENS // seqlen),
        nheads_q=nheads_q,
        nheads_kv=nheads_q // group,
    )


def parse_shape(spec: str):
    """'head_dim:seqlen[:causal][:gN]' (as the other benchmark scripts take it) -> grid_problem;
    gN: N query heads per K/V head (GQA), N dividing hidden / head_dim. ValueError otherwise."""
    head_dim, seqlen, *rest = spec.split(":")
    causal, group = False, 1
    for part in rest:
        if part == "causal" and not causal:
            causal = True
        elif part.startswith("g") and part[1:].isdigit() and group == 1:
            group = int(part[1:])
        else:
            raise ValueError(f"{part!r} in {spec!r}: want causal or gN")
    if group < 1 or (HIDDEN // int(head_dim)) % group:
        raise ValueError(
            f"g{group} must divide the {HIDDEN // int(head_dim)} query heads of {spec!r}"
        )
    return grid_problem(int(head_dim), int(seqlen), causal, group)


def grid(hdims, seqlens):
    for d in hdims:
        for s in seqlens:
            for causal in (False, True):
                yield grid_problem(d, s, causal)


def runners_for(q, k, v, out, lse, config, causal: bool, fa4) -> dict:
    """name -> a function of no arguments running that column once on q, k, v: fa4tune into `out`
    and `lse`, torch SDPA's cuDNN and flash backends, and flash-attn-4 when it is installed."""
    import torch
    import torch.nn.functional as F

    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # SDPA wants (b, h, s, d)

    def sdpa(backend):
        def run():
            with torch.nn.attention.sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

        return run

    runners = {
        "fa4tune": lambda: attention_forward(q, k, v, config, causal=causal, out=out, lse=lse),
        "sdpa-cudnn": sdpa(torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
        "sdpa-flash": sdpa(torch.nn.attention.SDPBackend.FLASH_ATTENTION),
    }
    if fa4 is not None:
        runners["flash-attn-4"] = lambda: fa4(q, k, v, causal=causal)
    return runners


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hdims", default="64,128")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--config", default=None, help="fa4tune knobs as JSON (default: the kernel default)"
    )
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per shape")
    args = ap.parse_args(argv)

    import torch

    from fa4tune.kernels.common.verify import TOLERANCES, compare, reference_slices
    from fa4tune.kernels.fa4_fwd_sm90 import FAMILY
    from fa4tune.kernels.fa4_fwd_sm90.compile import compile_forward
    from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
    from fa4tune.measure.timing import L2Flusher, time_cuda

    if not torch.cuda.is_available():
        print("benchmarks/attention.py needs an NVIDIA GPU", file=sys.stderr)
        return 2
    flusher = L2Flusher()
    fa4 = None
    if not args.no_peers:
        try:
            from flash_attn.cute import flash_attn_func as fa4
        except Exception as exc:  # not installed, or fails to import here
            print(f"# flash-attn-4 not available: {type(exc).__name__}: {exc}", file=sys.stderr)

    rows = []
    for p in grid(
        [int(x) for x in args.hdims.split(",")], [int(x) for x in args.seqlens.split(",")]
    ):
        d, s, causal, b, h = p.head_dim, p.seqlen_q, p.causal, p.batch, p.nheads_q
        g = dict(head_dim=d, seqlen=s, causal=causal, batch=b, nheads=h)
        cfg = (
            FwdConfig.from_dict(json.loads(args.config), base=FAMILY.default_config(p))
            if args.config
            else FAMILY.default_config(p)
        )
        compiled = compile_forward(cfg, "bf16", d, d, causal)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        # Poisoned, so that an element the kernel never writes fails the check.
        out = torch.full_like(q, float("nan"))
        lse = torch.full((b, h, s), float("nan"), device="cuda", dtype=torch.float32)
        # The project's correctness gate: fp32 reference on slices (both ends of batch, heads,
        # rows).
        references = reference_slices(q, k, v, causal, None)
        tolerance = TOLERANCES[p.dtype]

        runners = runners_for(q, k, v, out, lse, cfg, causal, fa4)

        row = dict(g, config=cfg.to_dict(), compile_s=round(compiled.compile_seconds, 2))
        timed = {}
        for name, fn in runners.items():
            try:
                res = fn()
                o = out if name == "fa4tune" else (res[0] if isinstance(res, tuple) else res)
                if name.startswith("sdpa"):
                    o = o.transpose(1, 2)
                result = compare(o, lse if name == "fa4tune" else None, references)
                row[name + "_err"] = result.out_error
                wrong = result.verdict(tolerance)
                if wrong:
                    row[name] = "wrong"
                    row[name + "_detail"] = wrong
                    continue
                timed[name] = []
            except Exception as exc:
                row[name] = f"error: {type(exc).__name__}"
                row[name + "_detail"] = str(exc)[:300]
        # Interleaved rounds: a transient slowdown hits one round of one column, not a whole column.
        for _ in range(args.rounds):
            for name in timed:
                timed[name].append(time_cuda(runners[name], flusher=flusher).median_ms)
        for name, medians in timed.items():
            ms = sorted(medians)[len(medians) // 2]
            row[name] = round(p.flops / (ms * 1e-3) / 1e12, 1)
            row[name + "_ms"] = ms
            row[name + "_round_spread"] = round((max(medians) - min(medians)) / ms, 4)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    names = ["fa4tune", "sdpa-cudnn", "sdpa-flash"] + (["flash-attn-4"] if fa4 is not None else [])
    print(f"\n| hdim | seqlen | causal | {' | '.join(names)} | fa4tune / flash-attn-4 |")
    print("|" + "---|" * (len(names) + 4))
    for r in rows:
        ratio = ""
        if isinstance(r.get("fa4tune"), float) and isinstance(r.get("flash-attn-4"), float):
            ratio = f"{r['fa4tune'] / r['flash-attn-4']:.2f}"
        cells = " | ".join(str(r.get(n, "")) for n in names)
        print(
            f"| {r['head_dim']} | {r['seqlen']} | "
            f"{'yes' if r['causal'] else 'no'} | {cells} | {ratio} |"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
