"""A/B of a knob change: the default and the table's config of each shape, each as is and with the
change, timed side by side.

    python benchmarks/ab.py --set q_stages=2 [--set wg_epilogue=true] [--kernel fa4_fwd_sm90]
                            [--shapes 64:1024,128:4096:causal | --job JOB.yaml [--match TEXT]]
                            [--table PATH [--table-target H200]] [--rounds 3] [--jobs 8]
                            [--json out.json]

Shapes are 'head_dim:seqlen[:causal][:gN]' at 16k tokens and hidden 2048 (gN: N query heads per K/V
head; benchmarks/attention.py); the default list is the tuning grid (head dims 64 and 128 at 1k, 4k,
16k, causal and not). `--job` takes a tuning job's problems instead (decode, ragged: any the job's
kernel family has), `--match` keeps those whose key holds the text (repeatable: any of them).
`tuned` is the config fa4tune.attention looks up (FA4TUNE_TABLE, FA4TUNE_DB, else the shipped
tables, or --table); the table says how it was found (exact, bucket, nearest,
other-dtype, default) and whether it is stale or an estimate. A table serves the GPU it was tuned
for: `--table-target` looks it up for that GPU while the runs measure this one (another GPU's tuned
configs here). Where a --table has no entry for a shape, stderr says so: `tuned` is then the
default. A variant the feasibility rules refuse, one that is the base itself (the base already has
the change) and one that fails to compile are listed as such, not timed, and left out of the
geometric means. The kernels compile first, in a
pool of --jobs processes (CPU work); then every column is checked against the fp32 reference on
random inputs (outputs poisoned with NaN first) and timed in interleaved rounds with the L2 flushed
(fa4tune.measure.timing), each column through the kernel family's measurement case (`--kernel`, the
forward's by default; `fa4_bwd_sm90` A/Bs a knob of the backward: its TFLOP/s count 2.5x the
forward's FLOPs), as the search measures candidates. Prints a markdown table last: TFLOP/s, the
ratio of each variant to its base (above 1: the change is faster), and the largest spread between
rounds of the shape's columns."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.attention import parse_shape  # noqa: E402
from benchmarks.sweep import parse_value  # noqa: E402
from benchmarks.tuning_report import check_then_time, geomean, gpu_target  # noqa: E402

GRID_SHAPES = ",".join(
    f"{d}:{s}{c}" for d in (64, 128) for s in (1024, 4096, 16384) for c in ("", ":causal")
)


def parse_changes(items: list[str], kernel: str = "fa4_fwd_sm90") -> dict:
    """{knob: value} from ["knob=value", ...]; a ValueError naming the item for anything the
    kernel family's config schema would not take."""
    from fa4tune.errors import Fa4tuneError
    from fa4tune.kernels import get_kernel

    try:
        family = get_kernel(kernel)
    except Fa4tuneError as exc:
        raise ValueError(f"--kernel: {exc}") from None
    changes = {}
    for item in items:
        knob, _, text = item.partition("=")
        if knob not in family.knobs or not text:
            raise ValueError(
                f"--set wants knob=value with a knob of {', '.join(family.knobs)} (got {item!r})"
            )
        try:
            value = parse_value(text)
        except ValueError:
            raise ValueError(
                f"--set {item!r}: {text!r} is neither a number nor true/false"
            ) from None
        try:
            changes[knob] = family.config({knob: value}).to_dict()[knob]  # 2.0 -> 2, legality
        except family.config_error as exc:
            raise ValueError(f"--set {item!r}: {exc}") from None
    return changes


def job_problems(path: str, matches: list[str], kernel: str) -> list:
    """The problems of the tuning job at `path` whose key holds one of `matches` (all without
    any); a ValueError saying what is wrong with the job, its kernel or the matches."""
    from fa4tune.errors import Fa4tuneError
    from fa4tune.tune.job import load_job

    try:
        job = load_job(path)
    except (OSError, Fa4tuneError) as exc:
        raise ValueError(f"--job {path}: {exc}") from None
    if job.kernel.name != kernel:
        raise ValueError(
            f"--job {path} tunes {job.kernel.name}, not --kernel {kernel}: give --kernel "
            f"{job.kernel.name}"
        )
    problems = [p for p in job.problems if not matches or any(m in p.key() for m in matches)]
    if not problems:
        raise ValueError(
            f"--match {' '.join(matches)}: none of the job's {len(job.problems)} problems has it "
            f"in its key (e.g. {job.problems[0].key()})"
        )
    return problems


def job_selection(shapes: str | None, job: str | None, matches: list[str], kernel: str):
    """--job's problems (job_problems), or None without --job; a ValueError for --shapes and --job
    together or --match without --job."""
    if job is not None and shapes is not None:
        raise ValueError("give --shapes or --job, not both")
    if matches and job is None:
        raise ValueError("--match filters a --job's problems: give --job")
    return None if job is None else job_problems(job, matches, kernel)


def columns_for(problem, default, tuned, changes: dict, target, kernel: str = "fa4_fwd_sm90"):
    """column name -> the family's config, or a string saying why the column is empty."""
    from fa4tune.kernels import get_kernel

    family = get_kernel(kernel)
    columns = {}
    for name, base in (("default", default), ("tuned", tuned)):
        columns[name] = base
        variant = type(base).from_dict(changes, base=base)
        reasons = family.infeasible_reasons(problem, variant, target)
        if reasons:
            columns[f"{name}+"] = "refused: " + "; ".join(reasons)
        elif variant.canonical() == base.canonical():
            columns[f"{name}+"] = f"= {name} (it has the change)"
        else:
            columns[f"{name}+"] = variant
    return columns


def compile_all(jobs: list, family, target, directory: Path, workers: int) -> dict:
    """Compile every (problem, config) in a spawned process pool and load the results here. Returns
    {(problem, config): why} for those that failed (compiling or loading)."""
    from fa4tune.measure.gpu import artifact_path
    from fa4tune.measure.gpu_worker import compile as compile_op  # the search's compile workers' op

    failed = {}
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        futures = [
            (
                problem,
                config,
                pool.submit(
                    compile_op,
                    {
                        "kernel": family.name,
                        "artifact": str(artifact_path(directory, family, config, problem, target)),
                        "problem": problem.to_dict(),
                        "config": config.to_dict(),
                        "target": target.name,
                    },
                    None,
                    {},
                ),
            )
            for problem, config in jobs
        ]
        for problem, config, future in futures:
            try:
                family.load(future.result()["artifact"], problem, config, target)
            except Exception as exc:  # noqa: BLE001 - one cell says so; the other columns still run
                failed[(problem, config)] = (
                    f"{type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
                    if str(exc)
                    else type(exc).__name__
                )
    return failed


def measure(problem, columns: dict, family, target, rounds: int) -> dict:
    """Each column's cell: its reason where it has no config, else checked against the fp32
    reference (outputs poisoned first), then timed. Each column runs on a measurement case of its
    own (the same random inputs: one seed), so that none passes on what another wrote."""
    import torch

    seed = problem.seqlen_q + problem.head_dim
    references = []  # the first column's, the same inputs for all

    def check(config):
        case = family.measurement_case(problem, torch.device("cuda"))
        family.randomize(case, seed)
        run = family.launcher(case, config, target)
        if not references:
            references.append(family.reference(case))
        family.poison(case)
        run()
        torch.cuda.synchronize()
        return run, family.compare(case, references[0])

    tolerance, flops = family.tolerance(problem), family.work_flops(problem)
    return check_then_time(problem, columns, check, tolerance, rounds, flops=flops)


def gain(cells: dict, base: str) -> float | None:
    a, b = cells.get(f"{base}+"), cells.get(base)
    if isinstance(a, dict) and isinstance(b, dict):
        return b["ms"] / a["ms"]
    return None


def cell_text(cell) -> str:
    if isinstance(cell, dict):
        return f"{cell['tflops']:.1f}"
    return str(cell)[:60]


def max_spread(cells: dict) -> float | None:
    spreads = [c["round_spread"] for c in cells.values() if isinstance(c, dict)]
    return max(spreads) if spreads else None


def tuned_lookup(problem, kernel: str, target, table=None, table_target=None):
    """`tuned`: (the lookup's result, how it was found) for problem, from `table` (None: what
    fa4tune.attention reads) looked up for table_target (None: `target`, the GPU measured on).
    Where `table` has no entry for the problem, stderr says so: `tuned` is then the default."""
    from fa4tune.runtime.lookup import lookup

    where = table_target or target
    found = lookup(problem, where, source=table, kernel=kernel)
    how = (
        found.source
        + (f", {where.name}'s" if table_target is not None else "")
        + (", stale" if found.stale else "")
        + (", estimate" if found.estimate else "")
    )
    if table is not None and found.source == "default":
        print(
            f"ab: --table {table} has no {where.name} entry for {problem.key()}: `tuned` is the "
            f"default config"
            + ("" if table_target is not None else " (--table-target: a table of another GPU)"),
            file=sys.stderr,
        )
    return found, how


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--set", action="append", default=[], metavar="KNOB=VALUE", help="the change (repeatable)"
    )
    ap.add_argument("--shapes", default=None, help="comma-separated head_dim:seqlen[:causal][:gN]")
    ap.add_argument("--job", default=None, help="a tuning job whose problems to use instead")
    ap.add_argument(
        "--match", action="append", default=[], help="with --job: keep problems whose key has it"
    )
    ap.add_argument("--kernel", default="fa4_fwd_sm90", help="the kernel family whose knob changes")
    ap.add_argument("--table", default=None, help="table file/dir or results DB for `tuned`")
    ap.add_argument(
        "--table-target", default=None, help="with --table: look it up for this GPU (e.g. H200)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=8, help="compile processes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        changes = parse_changes(args.set, args.kernel)
    except ValueError as exc:
        print(f"ab: {exc}", file=sys.stderr)
        return 2
    try:
        problems = job_selection(args.shapes, args.job, args.match, args.kernel) or []
    except ValueError as exc:
        print(f"ab: {exc}", file=sys.stderr)
        return 2
    for spec in (s for s in (args.shapes or ("" if args.job else GRID_SHAPES)).split(",") if s):
        try:
            problems.append(parse_shape(spec))
        except (ValueError, IndexError) as exc:  # a bad number, a missing part, or a ProblemError
            why = (
                str(exc)
                if type(exc).__name__ == "ProblemError"
                else "want head_dim:seqlen[:causal][:gN]"
            )
            print(f"ab: --shapes: {spec!r}: {why}", file=sys.stderr)
            return 2
    if not problems:
        print("ab: --shapes names no shape", file=sys.stderr)
        return 2
    if not changes:
        print("ab: nothing to compare: give at least one --set knob=value", file=sys.stderr)
        return 2
    if args.rounds < 1 or args.jobs < 1:
        print("ab: --rounds and --jobs must be at least 1", file=sys.stderr)
        return 2
    lookup_target = None
    if args.table_target is not None:
        from fa4tune.target import get_target

        if args.table is None:
            print("ab: --table-target names the GPU a --table serves: add --table", file=sys.stderr)
            return 2
        try:
            lookup_target = get_target(args.table_target)
        except ValueError as exc:  # TargetError: an unknown name, and the known ones
            print(f"ab: --table-target: {exc}", file=sys.stderr)
            return 2

    import torch

    from fa4tune.kernels import get_kernel

    target = gpu_target("benchmarks/ab.py")
    if target is None:
        return 2
    kernel = get_kernel(args.kernel)
    plans = []
    for problem in problems:
        default = kernel.default_config(problem, target)
        found, how = tuned_lookup(problem, kernel.name, target, args.table, lookup_target)
        columns = columns_for(problem, default, found.config, changes, target, kernel.name)
        plans.append((problem, how, columns))
    jobs = list(
        {(p, c) for p, _, columns in plans for c in columns.values() if not isinstance(c, str)}
    )
    with tempfile.TemporaryDirectory() as directory:
        failed = compile_all(jobs, kernel, target, Path(directory), args.jobs)
    rows = []
    for problem, how, columns in plans:
        columns = {
            n: f"compile failed: {failed[(problem, c)]}" if (problem, c) in failed else c
            for n, c in columns.items()
        }
        cells = measure(problem, columns, kernel, target, args.rounds)
        rows.append(
            {
                "key": problem.key(),
                "lookup": how,
                "cells": cells,
                "configs": {n: c if isinstance(c, str) else c.short() for n, c in columns.items()},
            }
        )
        print(
            f"{problem.key()}: " + ", ".join(f"{n} {cell_text(c)}" for n, c in cells.items()),
            file=sys.stderr,
            flush=True,
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {"device": torch.cuda.get_device_name(), "changes": changes, "rows": rows}, indent=1
            )
        )
    change = " ".join(f"{k}={v}" for k, v in changes.items())
    print(
        f"\n`+` = with {change}; {torch.cuda.get_device_name()}, "
        f"TFLOP/s, {args.rounds} interleaved rounds.\n"
    )
    names = ["default", "default+", "tuned", "tuned+"]
    print(
        "| shape | default config | tuned config (lookup) | "
        + " | ".join(names)
        + " | default+ / default | tuned+ / tuned | largest round spread |"
    )
    print("|" + "---|" * (len(names) + 6))
    for r in rows:
        ratios = [gain(r["cells"], base) for base in ("default", "tuned")]
        spread = max_spread(r["cells"])
        print(
            f"| {r['key']} | {r['configs']['default']} | {r['configs']['tuned']} ({r['lookup']}) | "
            + " | ".join(cell_text(r["cells"].get(n, "")) for n in names)
            + " | "
            + " | ".join("" if x is None else f"{x:.3f}" for x in ratios)
            + f" | {'' if spread is None else f'{spread:.1%}'} |"
        )
    for base in ("default", "tuned"):
        ratios = [x for x in (gain(r["cells"], base) for r in rows) if x is not None]
        if ratios:
            print(
                f"\n{base}+ / {base}, geometric mean over {len(ratios)} shapes: "
                f"{geomean(ratios):.3f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
