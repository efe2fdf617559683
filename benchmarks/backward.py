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
included) goes into the JSON beside them (benchmarks/kernel_phases.py, shared with decode.py).

A CTA's fixed cost: the main kernel's time of the MHA problems of one head dim and mask, fitted as
blocks x c + CTAs x o (blocks: the 128 x 128 query-key pairs the scores cover, the causal
triangle's with its diagonal; CTAs: 128-key blocks x K/V heads x batch) over the two problems of
the shortest walks (fewest blocks a CTA), for fa4tune and flash-attn-4 apart: o / c is what a CTA
costs beyond its blocks, in blocks (the first loads' wait, the epilogue, the mask's diagonal, the
tail), and each longer walk's time against the fit says what grows with the walk alone."""

from __future__ import annotations

import re
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


def peer_error(family, case, grads, refs) -> float:
    """A peer's (dq, dk, dv) measured as fa4tune's are: the family's check of the measurement case
    with the peer's gradients in place of its own (the same slices; NaN anywhere is NaN)."""
    from dataclasses import replace

    dq, dk, dv = grads
    return family.compare(replace(case, dq=dq, dk=dk, dv=dv), refs).out_error


def check_fa4tune(family, problem, config, target, case, refs):
    """(why fa4tune's backward with `config` is wrong, or None; its gradient error), from one call
    into poisoned outputs (the family's measurement case)."""
    import torch

    family.poison(case)
    family.launcher(case, config, target)()
    torch.cuda.synchronize()
    check = family.compare(case, refs)
    return check.verdict(family.tolerance(problem)), check.out_error


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
                wrong, error = check_fa4tune(family, problem, configs[name], target, case, refs)
            else:
                grads = backward()
                torch.cuda.synchronize()
                error, wrong = peer_error(family, case, grads, refs), None
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
    lines += fixed_cost_lines(rows)
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


# A problem key's shape (fa4tune.problem.Problem.key): head dims, mask, seqlens, batch, heads.
KEY_SHAPE = re.compile(
    r"-d(?P<d>\d+)x\d+-(?P<mask>full|causal)-q(?P<sq>\d+)-k(?P<sk>\d+)-b(?P<b>\d+)"
    r"-h(?P<hq>\d+)x(?P<hk>\d+)$"
)
BLOCK = 128  # the fit's unit: 128 queries x 128 keys; a CTA per 128 keys


def blocks_and_ctas(key: str):
    """(blocks, CTAs, (head dim, mask)) of an MHA problem key (causal: seqlen_q == seqlen_k), else
    None (GQA: the peers' CTAs per K/V head differ; causal with unequal seqlens)."""
    m = KEY_SHAPE.search(key)
    if not m:
        return None
    sq, sk, b, hq, hk = (int(m[x]) for x in ("sq", "sk", "b", "hq", "hk"))
    if hq != hk or (m["mask"] == "causal" and sq != sk):
        return None
    pairs = sq * sk if m["mask"] == "full" else sq * (sq + 1) / 2
    return b * hq * pairs / BLOCK**2, b * hk * -(-sk // BLOCK), (int(m["d"]), m["mask"])


def fixed_cost_fit(points):
    """(c, o, [time / fit - 1 of each later point]) of points (blocks, CTAs, main µs), sorted by
    blocks per CTA, fitted exactly on the first two; None where they do not fix both."""
    (w1, n1, t1), (w2, n2, t2) = points[:2]
    det = w1 * n2 - w2 * n1
    if not det:
        return None
    c, o = (t1 * n2 - t2 * n1) / det, (w1 * t2 - w2 * t1) / det
    return c, o, [t / (c * w + o * n) - 1 for w, n, t in points[2:]]


def main_us(row, name):
    """The main kernel's GPU time of a row's column `name` (None if its phases were not
    measured)."""
    cell = row["cells"].get(name)
    return (cell.get("phases_us") or {}).get("main") if isinstance(cell, dict) else None


def fixed_cost_lines(rows) -> list:
    """The table of a CTA's fixed cost (module docstring), from the rows' main-kernel phases."""
    groups: dict = {}
    for r in rows:
        shape = blocks_and_ctas(r["key"])
        if shape:
            groups.setdefault(shape[2], []).append((shape[0], shape[1], r))
    table = []
    for (d, mask), items in sorted(groups.items()):
        items.sort(key=lambda x: x[0] / x[1])
        if len(items) < 2:
            continue
        fits = []
        for name in ("tuned", FA4):
            times = [main_us(r, name) for _, _, r in items]
            points = [(w, n, t) for (w, n, _), t in zip(items, times)]
            fits.append(fixed_cost_fit(points) if all(times) else None)
        if not any(fits):
            continue

        def cost(fit):
            return f"{fit[0] * 1e3:.1f} ns, {fit[1] / fit[0]:.2f}" if fit else "-"

        beyond = []
        for i, (_, _, r) in enumerate(items[2:]):
            got = [f"{round(fit[2][i], 4) + 0.0:+.1%}" if fit else "-" for fit in fits]
            beyond.append(f"{r['key'].split('-')[3]}: {got[0]}, {got[1]}")
        table.append(
            f"| {d}, {mask} | {cost(fits[0])} | {cost(fits[1])} | {'; '.join(beyond) or '-'} |"
        )
    if not table:
        return []
    return [
        "",
        "## A CTA's fixed cost",
        "",
        "The main kernel's time fitted as blocks x c + CTAs x o over each group's two shortest "
        "walks (the module docstring says how): c per 128 x 128 block of the GPU's time, o / c a "
        "CTA's cost beyond its blocks, in blocks; each longer walk's time against the fit, "
        "fa4tune, flash-attn-4.",
        "",
        "| head dim, mask | fa4tune: c, o / c | flash-attn-4: c, o / c | longer walks against "
        "the fit |",
        "|---|---|---|---|",
        *table,
    ]


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
