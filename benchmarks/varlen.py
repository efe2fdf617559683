"""Ragged inputs at speed: fa4tune tuned and fa4tune's default against flash-attn-4's varlen call,
per ragged problem of a job (varlen prefill, paged decode, chunked prefill), in one run.

    python benchmarks/varlen.py [--job tuning_configs/h200-bf16-serving.yaml] [--rounds 3]
                                [--only KEY,...] [--json varlen.json] [--out docs/serving-report.md]
    python benchmarks/varlen.py --render varlen.json --out docs/serving-report.md

Each problem runs on its token mix (fa4tune.mixes: the lengths its search measured on; pages
shuffled; the case of fa4tune's measuring worker, with the K/V rows no sequence uses finite here, so
that a peer which reads and masks them is not failed for it). TFLOP/s = the mix's FLOPs / time;
effective TB/s = the K/V bytes of the mix / time (the H200's copy rate is 4.24 TB/s): the first for
prefill, the second for decode. `tuned` is the config fa4tune.attention_varlen takes (its lookup,
the rung shown), `default` the family's default for the problem. flash-attn-4 is
`flash_attn_varlen_func` on the same tensors, cu_seqlens, seqused_k and page table, with
return_lse=True. Every column is first checked against the fp32 reference per sequence (the
family's check, outputs poisoned with NaN), then timed in interleaved rounds of
`fa4tune.measure.timing.time_cuda` with the L2 flushed before every run: the median of the rounds'
medians. benchmarks/decode.py --job tuning_configs/h200-bf16-serving.yaml runs the paged decode
problems with its columns too."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tuning_report import (  # noqa: E402 - the shared measuring helpers
    check_then_time,
    flush_text,
    geomean,
    measured_gpu,
    run_benchmark,
)

from fa4tune.kernels.fa4_fwd_sm90.peers import FA4  # noqa: E402

PROG = "benchmarks/varlen.py"
COLUMNS = ("tuned", "default", FA4)


def ragged_case(problem, seed: int = 0):
    """The problem's measurement case on the GPU, with fresh inputs (unused K/V rows finite)."""
    from fa4tune.kernels.common import measure

    case = measure.ragged_case(problem, "cuda")
    measure.randomize(case, seed, unused_nan=False)
    return case


def fa4tune_runner(problem, config, target, case):
    """A column running fa4tune's kernel with `config` on the case: its own outputs, poisoned by
    `.poison()`; returns (O, LSE)."""
    import torch

    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_varlen_forward

    out, lse = torch.empty_like(case.out), torch.empty_like(case.lse)

    def run():
        attention_varlen_forward(
            case.q,
            case.k,
            case.v,
            config,
            case.ragged,
            causal=problem.causal,
            out=out,
            lse=lse,
            target=target,
        )
        return out, lse

    def poison():
        out.fill_(float("nan"))
        lse.fill_(float("nan"))

    run.poison = poison
    return run


def runners_for(problem, case, default, tuned, target, kernel) -> dict:
    """name -> a callable returning (O, LSE), or a string saying why the column is empty."""
    from fa4tune.kernels import PeerUnavailable

    runners = {
        "tuned": fa4tune_runner(problem, tuned, target, case),
        "default": fa4tune_runner(problem, default, target, case),
    }
    for peer in kernel.ragged_peers():
        try:
            runners[peer.name] = peer.prepare(problem, case)
        except PeerUnavailable as exc:
            runners[peer.name] = str(exc)
    return runners


def verify_and_time(problem, case, runners: dict, rounds: int) -> dict:
    """name -> cell: each runner checked against the fp32 reference per sequence (the family's
    check on the case with the runner's outputs) and, if right, timed; a wrong or failing column
    gets its reason as the cell."""
    import torch

    from fa4tune.kernels.common import measure
    from fa4tune.kernels.common.verify import TOLERANCES

    references = measure.reference(case)

    def check(runner):
        if hasattr(runner, "poison"):
            runner.poison()
        out, lse = runner()
        torch.cuda.synchronize()
        return runner, measure.check(replace(case, out=out, lse=lse), references)

    cells = check_then_time(problem, runners, check, TOLERANCES[problem.dtype], rounds)
    for cell in cells.values():
        if isinstance(cell, dict):
            cell["tbs"] = problem.kv_bytes / (cell["ms"] * 1e-3) / 1e12
    return cells


def measure_problem(problem, target, kernel, rounds: int) -> dict:
    from fa4tune.runtime.lookup import lookup

    found = lookup(problem, target, kernel=kernel.name)
    default = kernel.default_config(problem, target)
    case = ragged_case(problem)
    cells = verify_and_time(
        problem, case, runners_for(problem, case, default, found.config, target, kernel), rounds
    )
    return {
        "key": problem.key(),
        "regime": problem.regime,
        "tokens_q": sum(case.q_lens),
        "tokens_k": sum(case.k_lens),
        "kv_bytes": problem.kv_bytes,
        "tuned_config": found.config.short(),
        "tuned_source": found.source,
        "default_config": default.short(),
        "cells": cells,
    }


# ---- the report ----------------------------------------------------------------------------------
def rate(cell, regime: str):
    """TFLOP/s for prefill, TB/s for decode; None for a column without a time."""
    if not isinstance(cell, dict):
        return None
    return cell["tbs"] if regime == "decode" else cell["tflops"]


def ratio(row, a: str, b: str):
    x, y = rate(row["cells"].get(a), row["regime"]), rate(row["cells"].get(b), row["regime"])
    return x / y if x and y else None


def fmt_cell(cell, regime: str) -> str:
    value = rate(cell, regime)
    if value is None:
        return str(cell or "").replace("|", "/")
    return f"{value:.2f}" if regime == "decode" else f"{value:.0f}"


def summary(rows) -> list[str]:
    def fmt(x):
        return f"{x:.3f}" if x is not None else "not measured"

    lines = []
    for regime, unit in (("prefill", "TFLOP/s"), ("decode", "TB/s")):
        some = [r for r in rows if r["regime"] == regime]
        if not some:
            continue
        vs_fa4 = [ratio(r, "tuned", FA4) for r in some]
        measured = [x for x in vs_fa4 if x]
        lines.append(
            f"- {regime.capitalize()} ({unit}): tuned against flash-attn-4, lowest "
            f"**{fmt(min(measured, default=None))}x**, geometric mean {fmt(geomean(vs_fa4))}x, "
            f"{sum(x >= 1.0 for x in measured)} of {len(measured)} problems at or above 1.0; "
            f"tuned against the default, geometric mean "
            f"{fmt(geomean(ratio(r, 'tuned', 'default') for r in some))}x"
        )
    return lines


def render(rows, header: dict) -> str:
    lines = [
        f"# Serving report: ragged inputs on the {measured_gpu(header)}",
        "",
        f"Measured {header['date']} on {header['gpu']}; torch {header['torch']}, "
        f"nvidia-cutlass-dsl {header['dsl']}, flash-attn-4 {header['fa4']}; kernel hash "
        f"{header['kernel_hash'][:12]}. Written by `benchmarks/varlen.py --rounds "
        f"{header['rounds']}` from `{header['job']}` (its docstring says how each column is run, "
        "checked and timed). " + flush_text(header),
        "",
        "## Summary",
        "",
        *summary(rows),
        "",
        "## Per problem",
        "",
        "TFLOP/s (prefill) or effective TB/s (decode) of the problem's token mix per column; "
        "tuned: the config fa4tune.attention_varlen takes and the lookup's rung.",
        "",
        "| problem | tokens q / k | tuned config (rung) | default config | "
        + " | ".join(COLUMNS)
        + " | tuned / default | tuned / FA4 | O error tuned | FA4 |",
        "|" + "---|" * (len(COLUMNS) + 8),
    ]
    for r in rows:
        c = r["cells"]
        errors = [
            f"{c[n]['out_error']:.2e}" if isinstance(c.get(n), dict) else "-"
            for n in ("tuned", FA4)
        ]
        ratios = [ratio(r, "tuned", "default"), ratio(r, "tuned", FA4)]
        lines.append(
            f"| {r['key']} | {r['tokens_q']} / {r['tokens_k']} | {r['tuned_config']} "
            f"({r['tuned_source']}) | {r['default_config']} | "
            + " | ".join(fmt_cell(c.get(n), r["regime"]) for n in COLUMNS)
            + "".join(f" | {x:.3f}" if x else " | -" for x in ratios)
            + f" | {errors[0]} | {errors[1]} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    return run_benchmark(
        argv,
        doc=__doc__,
        prog=PROG,
        default_job="tuning_configs/h200-bf16-serving.yaml",
        only_help="comma-separated problem keys (default: every ragged problem)",
        takes=lambda problem: problem.layout.ragged,
        measure=measure_problem,
        describe=lambda row: ", ".join(
            f"{n} {fmt_cell(row['cells'].get(n), row['regime'])}" for n in COLUMNS
        ),
        render=render,
        record_job=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
