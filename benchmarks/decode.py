"""Decode at memory speed: effective TB/s of fa4tune tuned, fa4tune's default heuristic,
flash-attn-4 and cuDNN, per shape of the decode job, in one run.

    python benchmarks/decode.py [--job tuning_configs/h200-bf16-decode.yaml] [--rounds 3]
                                [--json decode.json] [--out docs/decode-report.md]

Effective TB/s = bytes of K and V / time (a decode call reads them once at the least; the H200's
measured copy rate is 4.24 TB/s). `tuned` is the config fa4tune.attention would take (its lookup:
$FA4TUNE_TABLE, $FA4TUNE_DB, else the shipped tables; the rung it came from is shown), `default` the
kernel family's default config for the problem (config.decode_default: packed GQA, 64-row tiles, the
wave-efficiency split rule), and `default-ck` the same config with its splits merged by the tile's
last CTA (`combine_in_kernel`) instead of the combine kernel, on the shapes where the default
splits: their ratio is the measurement that picks one of the two ways to merge. flash-attn-4 is
called with return_lse=True, as fa4tune always writes the LSE; cuDNN is torch SDPA without gradients
(O only; no column for causal with seqlen_q != seqlen_k, where SDPA's mask is top-left aligned).
Every column is first checked against the fp32 reference (fa4tune's with NaN-poisoned outputs), then
timed in interleaved rounds of `fa4tune.measure.timing.time_cuda` with the L2 flushed before every
run: the median of the rounds' medians. O's relative error against the reference is reported per
column. Ragged decode problems of a job (a paged cache, seqused_k, varlen q: `--job
tuning_configs/h200-bf16-serving.yaml`) run on their token mix as benchmarks/varlen.py runs them,
against flash-attn-4's varlen call with the same page table and lengths (no cuDNN column).

Where the call's time goes: after the timed rounds, the tuned column and `default-ck` run again
under torch.profiler (benchmarks/kernel_phases.py: CUDA activity only, the L2 flushed before each
of PROFILED_CALLS calls, outside the profile). Each GPU kernel's time is summed by phase (`PHASES`:
the forward kernel, the split-KV combine kernel, other) and the call's span runs from its first
kernel's start to its last kernel's end; of both the median over the calls. A kernel's time
excludes the gaps between launches, the span includes them (and counts once the stretch where the
combine kernel, started early by programmatic dependent launch, runs beside the forward kernel).
The report sets them beside the floor (K/V bytes at the copy rate) and the timed median. Ragged
problems are not profiled."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernel_phases  # noqa: E402 - where a call's GPU time goes (shared with backward.py)
from tuning_report import (  # noqa: E402 - the shared measuring helpers
    flush_text,
    geomean,
    gqa_native,
    measured_gpu,
    random_inputs,
    run_benchmark,
    runners_for,
    verify_and_time,
)

from fa4tune.kernels.fa4_fwd_sm90.peers import CUDNN, FA4, FA4_O  # noqa: E402

PROG = "benchmarks/decode.py"
IN_KERNEL = "default-ck"
COLUMNS = ("tuned", "default", IN_KERNEL, FA4, FA4_O, CUDNN)
BIG_KV = 256 * 2**20  # the 3.6 TB/s target holds on shapes whose K/V is at least this
# The copy rate (TB/s), the floor of a call that reads K and V once, per target: measured on the
# H200; another GPU takes its target's HBM rate (fa4tune.target), which the report names as such.
MEASURED_COPY_TBS = {"H200": 4.24}
BIG_KV_SHARE = 0.85  # the target at >= BIG_KV: 85% of the copy rate (3.6 TB/s on the H200)


def copy_rate(header: dict) -> tuple[float, str]:
    """(TB/s, how it was found) of the GPU a report measured."""
    from fa4tune.target import TargetError, get_target

    name = measured_gpu(header)
    if name in MEASURED_COPY_TBS:
        return MEASURED_COPY_TBS[name], "measured"
    try:
        return get_target(name).hbm_bytes_per_s / 1e12, f"the {name} target's HBM rate"
    except TargetError:  # a device fa4tune has no target for: the H200's, said so
        return MEASURED_COPY_TBS["H200"], f"the H200's (no {name} target)"


# (phase, a piece of the GPU kernel's name), as kernel_phases takes them: the CuTe DSL names a
# kernel `kernel_cutlass_kernel_<its class's module path and name>_object_at__<arguments>_<n>`,
# here ...fa4_fwd_sm90kernelFlashForwardSm90... (the forward kernel, kernel.py, split or not) and
# ...fa4_fwd_sm90combineSplitCombine... (the split-KV combine, combine.py).
PHASES = (("combine", "SplitCombine"), ("main", "FlashForwardSm90"))
PROFILED = ("tuned", IN_KERNEL)  # the columns whose calls are profiled after the timed rounds


def measure(problem, target, kernel, rounds: int) -> dict:
    from fa4tune.runtime.lookup import lookup

    if problem.layout.ragged:  # paged or varlen decode: flash-attn-4's varlen call the peer
        from varlen import measure_problem

        row = measure_problem(problem, target, kernel, rounds)
        for name, why in ((FA4_O, "n/a (ragged)"), (CUDNN, "n/a (ragged)")):
            row["cells"].setdefault(name, why)
        return row

    found = lookup(problem, target, kernel=kernel.name)
    default = kernel.default_config(problem, target)
    q, k, v = random_inputs(problem, seed=0)
    runners = runners_for(problem, default, found.config, target, q, k, v, kernel)
    runners[IN_KERNEL] = in_kernel_runner(problem, default, target, q, k, v, kernel)
    cells = verify_and_time(problem, runners, q, k, v, rounds)
    for cell in cells.values():
        if isinstance(cell, dict):
            cell["tbs"] = problem.kv_bytes / (cell["ms"] * 1e-3) / 1e12
    if isinstance(cells.get(CUDNN), dict) and not gqa_native(runners):
        cells[CUDNN]["note"] = "K/V heads repeated"
    profile_columns(runners, cells)
    return {
        "key": problem.key(),
        "kv_bytes": problem.kv_bytes,
        "tuned_config": found.config.short(),
        "tuned_source": found.source,
        "default_config": default.short(),
        "cells": cells,
    }


def profile_columns(runners, cells) -> None:
    """After the timed rounds: each column of PROFILED that was timed gets its phases and span
    (kernel_phases.profile_into, PHASES) in its cell, or why profiling failed; the others are left
    as they are."""
    from fa4tune.measure.timing import L2Flusher

    profiled = [name for name in PROFILED if isinstance(cells.get(name), dict)]
    if not profiled:
        return
    flusher = L2Flusher()
    for name in profiled:
        kernel_phases.profile_into(cells[name], runners[name], flusher, PHASES)


def in_kernel_runner(problem, default, target, q, k, v, kernel):
    """The default config with the in-kernel combine, or why there is none for the problem."""
    from dataclasses import replace

    from tuning_report import fa4tune_runner

    if not default.split:
        return "n/a (the default does not split)"
    config = replace(default, combine_in_kernel=True)
    reasons = kernel.infeasible_reasons(problem, config, target)
    if reasons:
        return "refused: " + "; ".join(reasons)
    return fa4tune_runner(problem, config, target, q, k, v)


def tbs(cells, name):
    cell = cells.get(name)
    return cell["tbs"] if isinstance(cell, dict) else None


def ratio(cells, a, b):
    x, y = tbs(cells, a), tbs(cells, b)
    return x / y if x and y else None


def headroom(rows, copy_tbs: float) -> tuple:
    """What tuning could gain over the default, as geometric means over the shapes where the
    default was measured: (each shape at the copy rate, default rate / copy_tbs inverted, at least
    1; each shape at the fastest rate of any column measured, over the default's, at least 1)."""
    at_copy, at_best = [], []
    for r in rows:
        default = tbs(r["cells"], "default")
        if not default:
            continue
        at_copy.append(max(1.0, copy_tbs / default))
        rates = [x for x in (tbs(r["cells"], name) for name in COLUMNS) if x]
        at_best.append(max(1.0, max(rates) / default))
    return geomean(at_copy), geomean(at_best)


def summary(rows, copy_tbs: float) -> list[str]:
    big = [r for r in rows if r["kv_bytes"] >= BIG_KV and tbs(r["cells"], "tuned")]
    best_peer = []
    for r in rows:
        peers = [x for x in (tbs(r["cells"], FA4), tbs(r["cells"], CUDNN)) if x]
        if peers and tbs(r["cells"], "tuned"):
            best_peer.append(tbs(r["cells"], "tuned") / max(peers))
    vs_fa4 = geomean(ratio(r["cells"], "tuned", FA4) for r in rows)
    vs_default = geomean(ratio(r["cells"], "tuned", "default") for r in rows)
    in_kernel = [ratio(r["cells"], IN_KERNEL, "default") for r in rows]
    in_kernel = [x for x in in_kernel if x]
    errors = []
    for r in rows:
        t, f = r["cells"].get("tuned"), r["cells"].get(FA4)
        if isinstance(t, dict) and isinstance(f, dict) and f.get("out_error"):
            errors.append(t["out_error"] / f["out_error"])

    def fmt(x, spec=".3f"):
        return format(x, spec) if x is not None else "not measured"

    lowest_big = min((tbs(r["cells"], "tuned") for r in big), default=None)
    ceiling, best_any = headroom(rows, copy_tbs)
    return [
        f"- Lowest tuned rate on the {len(big)} shapes with K/V of 256 MiB or more: "
        f"**{fmt(lowest_big, '.2f')} TB/s** (target ≥ {BIG_KV_SHARE * copy_tbs:.2f}: "
        f"{BIG_KV_SHARE:.0%} of the copy rate)",
        f"- Tuned against the faster of flash-attn-4 and cuDNN: lowest "
        f"**{fmt(min(best_peer, default=None))}x**, {sum(x >= 1.0 for x in best_peer)} of "
        f"{len(best_peer)} shapes at or above 1.0 (target: all)",
        f"- Tuned against flash-attn-4 (with LSE), geometric mean: **{fmt(vs_fa4)}x** "
        "(target ≥ 1.5)",
        f"- Tuned against the default heuristic, geometric mean: **{fmt(vs_default)}x** "
        "(target ≥ 1.10); the headroom: at most "
        f"**{fmt(ceiling)}x** if every shape ran at the copy rate ({copy_tbs:.2f} TB/s), "
        f"{fmt(best_any)}x where each took the fastest column measured (any of them)",
        f"- O's error, tuned over flash-attn-4's on the same inputs: highest "
        f"**{fmt(max(errors, default=None))}x** (target ≤ 1.1)",
        f"- The default's splits merged in the kernel (its tiles' last CTAs) against the combine "
        f"kernel, on the {len(in_kernel)} shapes where the default splits: geometric mean "
        f"**{fmt(geomean(in_kernel))}x**, lowest {fmt(min(in_kernel, default=None))}x, highest "
        f"{fmt(max(in_kernel, default=None))}x",
    ]


def fmt_cell(cell) -> str:
    if isinstance(cell, dict):
        return f"{cell['tbs']:.2f}" + (f" ({cell['note']})" if cell.get("note") else "")
    return str(cell).replace("|", "/")


def render(rows, header: dict) -> str:
    copy_tbs, copy_source = copy_rate(header)
    lines = [
        f"# Decode report: fa4_fwd_sm90 on the {measured_gpu(header)}",
        "",
        f"Measured {header['date']} on {header['gpu']}; torch {header['torch']}, "
        f"nvidia-cutlass-dsl {header['dsl']}, flash-attn-4 {header['fa4']}; kernel hash "
        f"{header['kernel_hash'][:12]}. Written by `benchmarks/decode.py --rounds "
        f"{header['rounds']}` (its docstring says how each column is run, checked and timed). "
        f"Effective TB/s = bytes of K and V / median time; the copy rate is {copy_tbs:.2f} TB/s "
        f"({copy_source}). " + flush_text(header),
        "",
        "## Summary",
        "",
        *summary(rows, copy_tbs),
        "",
        "## Per shape",
        "",
        "TB/s per column. Tuned: the config fa4tune.attention takes, and the lookup's rung. "
        "Errors: O against the fp32 reference (relative), tuned / flash-attn-4.",
        "",
        "| problem | K/V MiB | tuned config (rung) | default config | "
        + " | ".join(COLUMNS)
        + " | tuned / default | tuned / FA4 | tuned / max(FA4, cuDNN) | O error tuned | FA4 |",
        "|" + "---|" * (len(COLUMNS) + 9),
    ]
    for r in rows:
        c = r["cells"]
        peers = [x for x in (tbs(c, FA4), tbs(c, CUDNN)) if x]
        best = tbs(c, "tuned") / max(peers) if peers and tbs(c, "tuned") else None
        err = [
            f"{c[n]['out_error']:.2e}" if isinstance(c.get(n), dict) else "-"
            for n in ("tuned", FA4)
        ]
        ratios = [ratio(c, "tuned", "default"), ratio(c, "tuned", FA4), best]
        lines.append(
            f"| {r['key']} | {r['kv_bytes'] / 2**20:.0f} | {r['tuned_config']} "
            f"({r['tuned_source']}) | {r['default_config']} | "
            + " | ".join(fmt_cell(c.get(n, "")) for n in COLUMNS)
            + "".join(f" | {x:.3f}" if x else " | -" for x in ratios)
            + f" | {err[0]} | {err[1]} |"
        )
    lines += phase_lines(rows, copy_tbs)
    return "\n".join(lines) + "\n"


def phase_lines(rows, copy_tbs: float) -> list[str]:
    """The table of where the decode call's time goes: a line per problem for the tuned column and
    one for `default-ck` where it was timed; '-' where a column has no profile (a ragged problem,
    or a JSON written before the profile), combine '-' where no combine kernel ran. Nothing when no
    row has a profile."""

    def profiled(cell):
        return isinstance(cell, dict) and "phases_us" in cell

    if not any(profiled(r["cells"].get(name)) for r in rows for name in PROFILED):
        return []

    def us(x):
        return f"{x:.1f}" if x is not None else "-"

    lines = [
        "",
        "## Where the decode call's time goes",
        "",
        f"GPU time per kernel in µs, the median of {kernel_phases.PROFILED_CALLS} calls under "
        "torch.profiler (L2 flushed before each), of the tuned column and of `default-ck` (its "
        "splits merged in the kernel: no combine kernel). main: the forward kernel; combine: the "
        "split-KV combine kernel, launched early as the main kernel's programmatic dependent (its "
        "time can include its wait for the main kernel's end); other: any other kernel. A "
        "kernel's time excludes the gaps between launches; the span (first kernel's start to last "
        "kernel's end) includes them, so span - main is what the call costs beyond its main "
        f"kernel. Floor: K/V bytes at the copy rate ({copy_tbs:.2f} TB/s); timed: the column's "
        "median in the timed rounds, between CUDA events around the call; main TB/s: K/V bytes / "
        "main.",
        "",
        "| problem | column | K/V MiB | floor µs | main µs | combine µs | other µs | span µs "
        "| timed µs | main TB/s |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        floor = r["kv_bytes"] / (copy_tbs * 1e12) * 1e6
        for name in PROFILED:
            cell = r["cells"].get(name)
            if name != "tuned" and not isinstance(cell, dict):
                continue  # not timed here (the default does not split, or it failed)
            timed = cell["ms"] * 1e3 if isinstance(cell, dict) and "ms" in cell else None
            main = combine = other = span = rate = None
            if profiled(cell):
                phases = cell["phases_us"]
                main, combine = phases.get("main"), phases.get("combine")
                other = sum(v for k, v in phases.items() if k not in ("main", "combine"))
                span = cell.get("span_us")
                rate = r["kv_bytes"] / (main * 1e-6) / 1e12 if main else None
            lines.append(
                f"| {r['key']} | {name} | {r['kv_bytes'] / 2**20:.0f} | {floor:.1f} | "
                + " | ".join(us(x) for x in (main, combine, other, span, timed))
                + f" | {f'{rate:.2f}' if rate else '-'} |"
            )
    return lines


def main(argv=None) -> int:
    return run_benchmark(
        argv,
        doc=__doc__,
        prog=PROG,
        default_job="tuning_configs/h200-bf16-decode.yaml",
        only_help="comma-separated problem keys (default: every problem)",
        takes=lambda problem: problem.regime == "decode",
        measure=measure,
        describe=lambda row: ", ".join(f"{n} {fmt_cell(row['cells'].get(n, ''))}" for n in COLUMNS),
        render=render,
    )


if __name__ == "__main__":
    raise SystemExit(main())
