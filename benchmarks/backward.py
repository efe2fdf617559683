"""Training speed: the backward pass alone and forward + backward, of fa4tune (the backward's tuned
config, the tuned config made deterministic, and its default), flash-attn-4 and cuDNN SDPA, per
problem of the training job, in one run.

    python benchmarks/backward.py [--job tuning_configs/h200-bf16-train.yaml] [--rounds 3]
                                  [--json backward.json] [--out docs/backward-report.md]
    python benchmarks/backward.py --render backward.json --out docs/backward-report.md

TFLOP/s count the backward as 2.5x the forward's FLOPs (five GEMMs against two; the forward's
convention halves causal), forward + backward as 3.5x. Each column's gradients are first checked
against the fp32 reference (fa4tune's with poisoned outputs: the family's measurement case), then
timed in interleaved rounds of `fa4tune.measure.timing.time_cuda` with the L2 flushed before every
run: the median of the rounds' medians. The backward alone runs from saved forward outputs
(autograd.grad with retain_graph for the peers); forward + backward runs both from the inputs
(fa4tune: its tuned forward, then the column's backward config). The deterministic column runs
what `torch.use_deterministic_algorithms` gets (`config.deterministic_config` of the tuned config:
dQ's sums in the order of the K blocks), so its ratio to the tuned column is that mode's cost.
The gradient error (the largest of dq, dk, dv against fp32, relative) is reported per column.

Where the backward's time goes: after the timed rounds, the tuned column's backward and
flash-attn-4's run again under torch.profiler (CUDA activity only; the L2 flushed before each of
kernel_phases.PROFILED_CALLS calls, outside the profile), and each GPU kernel's time is summed by
phase (`PHASES`: preprocess, zeroing, main kernel, cast or postprocess), the median over the
calls. A kernel's time alone, without the gaps between launches, so the phases add up to less than
the timed backward; the call's span (its first kernel's start to its last kernel's end, gaps
included) goes into the JSON beside them (benchmarks/kernel_phases.py, shared with decode.py)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernel_phases  # noqa: E402 - where a call's GPU time goes (shared)
from tuning_report import flush_text, geomean, measured_gpu, run_benchmark  # noqa: E402

from fa4tune.kernels.fa4_bwd_sm90.peers import CUDNN, FA4  # noqa: E402

PROG = "benchmarks/backward.py"
COLUMNS = ("tuned", "deterministic", "default", FA4, CUDNN)
OURS = ("tuned", "deterministic", "default")


# (phase, a piece of the GPU kernel's name): the first that matches names a kernel's phase. Ours:
# the preprocessing kernel (BackwardPreprocess), the main kernel (FlashBackwardSm90), torch's cast
# of dQ (a copy kernel), and torch's fill if the accumulator is zeroed apart; flash-attn-4's:
# FlashAttentionBackward{Preprocess,Sm90,Postprocess}.
PHASES = (
    ("cast", "FlatDqCast"),  # dq_flat's cast kernel (its module path says "postprocess")
    ("preprocess", "Preprocess"),
    ("postprocess", "Postprocess"),
    ("main", "BackwardSm90"),
    ("zero", "FillFunctor"),
    ("zero", "emset"),
    ("cast", "copy"),
)


def gradient_error(grads, refs) -> float:
    return max(
        ((g.float() - r).norm() / r.norm()).item() for g, r in zip(grads, refs) if r.norm() > 0
    )


def fa4tune_columns(problem, config, target, case):
    """(backward alone, forward + backward) of fa4tune with the backward config `config`."""
    from fa4tune.kernels.fa4_bwd_sm90.launch import attention_backward

    def backward():
        return attention_backward(
            case.dout, case.q, case.k, case.v, case.out, case.lse, config,
            causal=problem.causal, target=target,
        )  # fmt: skip

    def both():  # fa4tune.attention's forward (its tuned config), then this backward config
        from fa4tune.runtime import dispatch

        out, lse = dispatch.attention(case.q, case.k, case.v, problem.causal)
        return attention_backward(
            case.dout, case.q, case.k, case.v, out, lse, config, causal=problem.causal,
            target=target,
        )  # fmt: skip

    return backward, both


def peer_columns(problem, case, name):
    """(backward alone, forward + backward) of a peer, or a string saying why it cannot run."""
    from fa4tune.kernels import PeerUnavailable
    from fa4tune.kernels.fa4_bwd_sm90.peers import cudnn_backward, fa4_backward

    prepare = {FA4: fa4_backward, CUDNN: cudnn_backward}[name]
    try:
        backward = prepare(problem, case.q, case.k, case.v, case.dout)
    except PeerUnavailable as exc:
        return str(exc), str(exc)

    def both():  # the peer's forward, then its backward
        return prepare(problem, case.q, case.k, case.v, case.dout)()

    return backward, both


def measure(problem, target, rounds: int) -> dict:
    import torch

    from fa4tune.kernels import get_kernel
    from fa4tune.kernels.fa4_bwd_sm90.config import deterministic_config
    from fa4tune.measure.timing import L2Flusher, round_order, time_cuda
    from fa4tune.runtime.lookup import lookup

    family = get_kernel("fa4_bwd_sm90")
    found = lookup(problem, target, kernel=family.name)
    default = family.default_config(problem, target)
    configs = {
        "tuned": found.config,
        "deterministic": deterministic_config(found.config, problem, target),
        "default": default,
    }
    case = family.measurement_case(problem, "cuda")
    family.randomize(case, 0)
    refs = family.reference(case)
    columns = {}
    for name, config in configs.items():
        columns[name] = fa4tune_columns(problem, config, target, case)
    for name in (FA4, CUDNN):
        columns[name] = peer_columns(problem, case, name)
    cells = {}
    timed = {}
    for name, (backward, both) in columns.items():
        if isinstance(backward, str):
            cells[name] = backward
            continue
        try:
            if name in OURS:
                family.poison(case)
                family.launcher(case, configs[name], target)()
                torch.cuda.synchronize()
                check = family.compare(case, refs)
                wrong, error = check.verdict(family.tolerance(problem)), check.out_error
            else:
                grads = backward()
                torch.cuda.synchronize()
                group = problem.qheads_per_kvhead
                errors = []
                for (b, h), dq, dk, dv in refs:
                    got = (
                        grads[0][b : b + 1, :, h * group : (h + 1) * group],
                        grads[1][b : b + 1, :, h : h + 1],
                        grads[2][b : b + 1, :, h : h + 1],
                    )
                    errors.append(gradient_error(got, (dq, dk, dv)))
                error, wrong = max(errors), None
        except Exception as exc:
            cells[name] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            continue
        if wrong:
            cells[name] = f"wrong ({wrong})"
            continue
        timed[name] = (backward, both)
        cells[name] = {"grad_error": error}
    flusher, names = L2Flusher(), list(timed)
    medians = {(n, part): [] for n in names for part in ("bwd", "fwd_bwd")}
    for index in range(rounds):
        for n in (names[i] for i in round_order(len(names), index)):
            for part, fn in zip(("bwd", "fwd_bwd"), timed[n]):
                medians[(n, part)].append(time_cuda(fn, flusher=flusher).median_ms)
    for n in ("tuned", FA4):
        if n in timed:
            kernel_phases.profile_into(cells[n], timed[n][0], flusher, PHASES)
    for n in names:
        bwd = statistics.median(medians[(n, "bwd")])
        both = statistics.median(medians[(n, "fwd_bwd")])
        cells[n].update(
            bwd_ms=bwd,
            bwd_tflops=2.5 * problem.flops / (bwd * 1e-3) / 1e12,
            fwd_bwd_ms=both,
            fwd_bwd_tflops=3.5 * problem.flops / (both * 1e-3) / 1e12,
        )
    return {
        "key": problem.key(),
        "tuned_config": found.config.short(),
        "tuned_source": found.source,
        "default_config": default.short(),
        "deterministic_config": configs["deterministic"].short(),
        "cells": cells,
    }


def rate(cell, part):
    return cell.get(f"{part}_tflops") if isinstance(cell, dict) else None


def render(rows, header) -> str:
    def ratio(row, part, a, b):
        x, y = rate(row["cells"].get(a), part), rate(row["cells"].get(b), part)
        return x / y if x and y else None

    def fmt(x, spec=".3f"):
        return format(x, spec) if x is not None else "not measured"

    bwd_fa4 = [ratio(r, "bwd", "tuned", FA4) for r in rows]
    det_cost = [ratio(r, "bwd", "deterministic", "tuned") for r in rows]
    both_fa4 = [ratio(r, "fwd_bwd", "tuned", FA4) for r in rows]
    errors = []
    for r in rows:
        t, f = r["cells"].get("tuned"), r["cells"].get(FA4)
        if isinstance(t, dict) and isinstance(f, dict) and f.get("grad_error"):
            errors.append(t["grad_error"] / f["grad_error"])
    lines = [
        f"# Backward report: fa4_bwd_sm90 on the {measured_gpu(header)}",
        "",
        f"Measured {header['date']} on {header['gpu']}; torch {header['torch']}, "
        f"nvidia-cutlass-dsl {header['dsl']}, flash-attn-4 {header['fa4']}; kernel hash "
        f"{header['kernel_hash'][:12]}. Written by `benchmarks/backward.py --rounds "
        f"{header['rounds']}` (its docstring says how each column is run, checked and timed). "
        + flush_text(header),
        "",
        "## Summary",
        "",
        f"- Backward against flash-attn-4: lowest "
        f"**{fmt(min((x for x in bwd_fa4 if x), default=None))}x**, geometric mean "
        f"**{fmt(geomean(bwd_fa4))}x** (targets: >= 1.0 on every shape, >= 1.05 geomean)",
        f"- Forward + backward against flash-attn-4, geometric mean **{fmt(geomean(both_fa4))}x** "
        "(target >= 1.05)",
        f"- Gradient error over flash-attn-4's, highest **{fmt(max(errors, default=None))}x** "
        "(target <= 1.1)",
        f"- Deterministic mode against the tuned (atomic) backward: geometric mean "
        f"**{fmt(geomean(det_cost))}x**, lowest {fmt(min(filter(None, det_cost), default=None))}x"
        " (its speed; bitwise repeatability is a GPU test)",
        "",
        "## Per shape",
        "",
        "TFLOP/s, backward alone / forward + backward.",
        "",
        "| problem | tuned config (rung) | deterministic | default | " + " | ".join(COLUMNS)
        + " | bwd tuned / FA4 | fwd+bwd tuned / FA4 | grad error tuned | FA4 |",
        "|" + "---|" * (len(COLUMNS) + 8),
    ]  # fmt: skip

    def cell(x):
        if isinstance(x, dict):
            return f"{x['bwd_tflops']:.0f} / {x['fwd_bwd_tflops']:.0f}"
        return str(x or "").replace("|", "/")

    for r in rows:
        c = r["cells"]

        err = [
            f"{c[n]['grad_error']:.2e}" if isinstance(c.get(n), dict) else "-"
            for n in ("tuned", FA4)
        ]
        ratios = [ratio(r, "bwd", "tuned", FA4), ratio(r, "fwd_bwd", "tuned", FA4)]
        lines.append(
            f"| {r['key']} | {r['tuned_config']} ({r['tuned_source']}) | "
            f"{r.get('deterministic_config', '-')} | {r['default_config']} | "
            + " | ".join(cell(c.get(n)) for n in COLUMNS)
            + "".join(f" | {x:.3f}" if x else " | -" for x in ratios)
            + f" | {err[0]} | {err[1]} |"
        )
    lines += phase_lines(rows)
    return "\n".join(lines) + "\n"


def phase_lines(rows) -> list:
    """The table of where the backward's time goes (rows measured with phases only)."""
    ours = ("preprocess", "zero", "main", "cast", "other")
    peers = ("preprocess", "main", "postprocess", "other")

    def phases(row, name):
        cell = row["cells"].get(name)
        return cell.get("phases_us") if isinstance(cell, dict) else None

    def us(p, name):
        return f"{p[name]:.0f}" if p and name in p else "-"

    measured = [r for r in rows if phases(r, "tuned") or phases(r, FA4)]
    if not measured:
        return []
    lines = [
        "",
        "## Where the backward's time goes",
        "",
        f"GPU time per kernel in µs (the median of {kernel_phases.PROFILED_CALLS} profiled calls, "
        "L2 flushed before each; launch gaps excluded). fa4tune's tuned config: preprocessing "
        "(with the dQ accumulator's zeros), a separate zeroing if any, "
        "the main kernel and dQ's cast; flash-attn-4: preprocessing, main kernel, postprocessing; "
        "other: any kernel not named in `PHASES`.",
        "",
        "| problem | " + " | ".join(f"fa4tune {n}" for n in ours) + " | "
        + " | ".join(f"FA4 {n}" for n in peers) + " | main fa4tune / FA4 (time) | "
        "rest fa4tune / FA4 (time) |",
        "|" + "---|" * (len(ours) + len(peers) + 3),
    ]  # fmt: skip
    for r in measured:
        a, b = phases(r, "tuned"), phases(r, FA4)
        main_ratio = rest_ratio = "-"
        if a and b and a.get("main") and b.get("main"):
            main_ratio = f"{a['main'] / b['main']:.3f}"
            rest_a = sum(v for k, v in a.items() if k != "main")
            rest_b = sum(v for k, v in b.items() if k != "main")
            rest_ratio = f"{rest_a / rest_b:.3f}" if rest_b else "-"
        lines.append(
            f"| {r['key']} | " + " | ".join(us(a, n) for n in ours) + " | "
            + " | ".join(us(b, n) for n in peers) + f" | {main_ratio} | {rest_ratio} |"
        )  # fmt: skip
    return lines


def main(argv=None) -> int:
    return run_benchmark(
        argv,
        doc=__doc__,
        prog=PROG,
        default_job="tuning_configs/h200-bf16-train.yaml",
        only_help="comma-separated problem keys",
        takes=lambda problem: True,
        measure=lambda problem, target, kernel, rounds: measure(problem, target, rounds),
        describe=lambda row: row["cells"],
        render=render,
    )


if __name__ == "__main__":
    raise SystemExit(main())
