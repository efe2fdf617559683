"""Shapes the tuned table does not hold: what `fa4tune.attention` borrows for them, measured.

For each shape, the config the runtime lookup picks (the same bucket, else the nearest tuned
problem; `fa4tune.lookup`) is timed beside the kernel's default and the peers, as in
docs/tuning-report.md (interleaved rounds, L2 flushed, every column checked against the fp32
reference first). It answers whether a user whose shape was never searched still gains from the
table, or loses.

    python benchmarks/off_table.py [--shapes 64:2048,64:8192:causal,...] [--dtype fp16]
                                   [--table PATH] [--rounds 3] [--json out.json]

Shapes are 'head_dim:seqlen[:causal][:gN]' at batch 16384 // seqlen (16k tokens; 15k at 3072) and
hidden 2048 (as benchmarks/attention.py takes them). The default list: head dims 64 and 128 at
seqlens 2048 and 8192 (between the grid's), and 3072 (not a power of two), causal and not. `--dtype
fp16` asks the same of fp16 problems, which a bf16-only table serves from its sibling-dtype rung.
Prints a markdown table last."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention import parse_shape  # noqa: E402
from benchmarks.tuning_report import (  # noqa: E402
    COLUMNS,
    fmt_cell,
    geomean,
    gpu_target,
    measure_problem,
    ratio,
    ratio_cells,
)

DEFAULT_SHAPES = ",".join(
    f"{d}:{s}{c}" for d in (64, 128) for s in (2048, 3072, 8192) for c in ("", ":causal")
)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--shapes", default=DEFAULT_SHAPES, help="comma-separated head_dim:seqlen[:causal][:gN]"
    )
    ap.add_argument(
        "--table",
        default=None,
        help="table file/dir or results DB (default: what "
        "fa4tune.attention reads: FA4TUNE_TABLE, FA4TUNE_DB, else the shipped tables)",
    )
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        problems = [replace(parse_shape(s), dtype=args.dtype) for s in args.shapes.split(",") if s]
    except (ValueError, IndexError):
        print(
            f"off_table: --shapes wants head_dim:seqlen[:causal][:gN],... (got {args.shapes!r})",
            file=sys.stderr,
        )
        return 2
    if args.rounds < 1:
        print("off_table: --rounds must be at least 1", file=sys.stderr)
        return 2

    import torch

    from fa4tune.cli import config_text
    from fa4tune.kernels import get_kernel
    from fa4tune.runtime.lookup import lookup

    target = gpu_target("benchmarks/off_table.py")
    if target is None:
        return 2
    fa4, fa4_error = None, None
    try:
        from flash_attn.cute import flash_attn_func as fa4
    except Exception as exc:  # not installed, or it does not import here
        fa4_error = f"{type(exc).__name__}: {exc}"[:100]

    kernel = get_kernel("fa4_fwd_sm90")
    rows = []
    for problem in problems:
        default = kernel.default_config(problem, target)
        found = lookup(problem, target, source=args.table, kernel=kernel.name)
        row = {
            "key": problem.key(),
            "how": found.source,
            "from": found.problem_key,
            "stale": found.stale,
            "default": default.short(),
            "changed": config_text(found.config.to_dict(), default.to_dict()),
        }
        row["cells"] = measure_problem(
            problem, default, found.config, target, fa4, fa4_error, args.rounds
        )
        print(
            f"{row['key']}: {row['how']} {row['from']}: "
            + ", ".join(f"{c} {fmt_cell(row['cells'].get(c, ''))}" for c in COLUMNS),
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)

    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1)
        )
    print(
        f"\nOff-table shapes on {torch.cuda.get_device_name()}, "
        f"TFLOP/s ({args.rounds} interleaved rounds); "
        "`borrowed` is the config fa4tune.attention runs (lookup rung, tuned problem).\n"
    )
    print(
        "| shape | lookup | borrowed (changed knobs) | "
        + " | ".join(COLUMNS).replace("tuned", "borrowed")
        + " | borrowed / default | borrowed / FA4 | borrowed / FA4, O only |"
    )
    print("|" + "---|" * (len(COLUMNS) + 6))
    for r in rows:
        print(
            f"| {r['key']} | {r['how']}"
            + (f" ({r['from']}{', stale' if r['stale'] else ''})" if r["from"] else "")
            + f" | {r['changed']} | "
            + " | ".join(fmt_cell(r["cells"].get(c, "")) for c in COLUMNS)
            + ratio_cells(r["cells"])
            + " |"
        )
    ratios = [x for x in (ratio(r["cells"], "tuned", "default") for r in rows) if x is not None]
    if ratios:
        print(
            f"\nborrowed / default, geometric mean over {len(ratios)} of {len(rows)} shapes: "
            f"{geomean(ratios):.3f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
