"""Write docs/tuning-report.md: default, tuned, flash-attn-4 and cuDNN measured side by side.

From the results DB of a GPU search: per problem the default and the tuned config, their TFLOP/s and
flash-attn-4's and cuDNN's (one process, interleaved rounds), the trials the search needed to reach
its best, and its wall time. fa4tune always writes O and LSE, so flash-attn-4 is timed doing the
same (`return_lse=True`: the column the target is judged by) and, beside it, as it runs by default,
O alone; cuDNN (torch SDPA, no gradient) computes O alone.

    python benchmarks/tuning_report.py [--db fa4tune-results/h200-bf16.db]
                                       [--job tuning_configs/h200-bf16.yaml]
                                       [--out docs/tuning-report.md] [--rounds 5]

Every column is checked against the fp32 reference (slices, fa4tune.kernels.common.verify) before it
is timed; a column whose implementation is missing, fails or is wrong says so instead of a number.
The report is written whole at the end, or not at all."""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fa4tune.kernels.fa4_fwd_sm90.peers import CUDNN, FA4, FA4_O  # noqa: E402

COLUMNS = ("default", "tuned", FA4, FA4_O, CUDNN)
# How the L2 flush before every timed run left L2 (the header's "flush", run_header: the mode of
# fa4tune.measure.timing.flush_mode), as the reports say it. A dirty L2 costs a short call the
# write-back of up to L2's size of lines: part of every column's time, not of the call's own work.
FLUSH_TEXT = {
    "clean": "The L2 flush before every run read a buffer twice its size (clean lines: no "
    "write-back in the timed runs).",
    "dirty": "The L2 flush before every run overwrote a buffer twice its size (dirty lines: their "
    "write-back is in every column's time, up to L2's size of DRAM traffic beyond the call's own; "
    "FA4TUNE_L2_FLUSH=dirty).",
}
GRID_HEAD_DIMS, GRID_SEQLENS = (64, 128), (1024, 4096, 16384)
NEAR_BEST = 0.02  # "reached the best": within 2% of the search's final best


class ReportError(Exception):
    pass


def is_grid(problem) -> bool:
    """The benchmark grid of the design notes: 16k tokens, hidden 2048."""
    return (
        problem.head_dim in GRID_HEAD_DIMS
        and problem.seqlen_q in GRID_SEQLENS
        and problem.seqlen_q == problem.seqlen_k
        and problem.batch * problem.seqlen_q == 16384
        and problem.nheads_q * problem.head_dim == 2048
        and problem.nheads_kv == problem.nheads_q
    )


# ---- what the search did -------------------------------------------------------------------------
def search_story(db, problem_key: str, best) -> dict:
    """Trials (measured, in order) until the search first held a config within 2% of its final best,
    and until it first measured the config that became best; the search's wall time."""
    from fa4tune.db.store import CONFIRM_SOURCE

    trials = [
        t
        for t in db.trials(problem_key=problem_key)
        if t["kernel_hash"] == best.kernel_hash and t["target"] == best.target
    ]
    search = [t for t in trials if t["source"] != CONFIRM_SOURCE and t["status"] != "pruned"]
    if not search:
        return {"measured": 0}
    final = min((t["time_ms"] for t in search if t["status"] == "ok"), default=None)
    to_near = to_best = None
    running = math.inf
    for index, t in enumerate(search, start=1):
        if t["status"] == "ok":
            running = min(running, t["time_ms"])
            if to_near is None and final is not None and running <= final * (1 + NEAR_BEST):
                to_near = index
            if to_best is None and t["config"] == best.config:
                to_best = index
    stamps = [t["created_at"] for t in trials]
    return {
        "measured": len(search),
        "to_near": to_near,
        "to_best": to_best,
        "wall_s": (max(stamps) - min(stamps)).total_seconds() if len(stamps) > 1 else 0.0,
        "stopped": sum(t["status"] == "stopped" for t in search),
        "failed": sum(t["status"] in ("failed", "wrong") for t in search),
    }


# ---- measuring side by side ----------------------------------------------------------------------
def preload(directory, kernel, config, problem, target) -> bool:
    """Load the kernel the search exported for `config`, if it is there; False: it will be
    compiled."""
    from fa4tune.measure.gpu import artifact_path

    path = artifact_path(directory, kernel, config, problem, target)
    if not path.exists():
        return False
    try:
        kernel.load(path, problem, config, target)
    except Exception as exc:  # noqa: BLE001 - compiling instead is slower, not wrong
        print(
            f"tuning_report: could not load {path.name} ({type(exc).__name__}: {exc}); "
            "compiling instead",
            file=sys.stderr,
        )
        return False
    return True


def random_inputs(problem, seed: int):
    """Fresh random q, k, v of the problem on the current GPU, (batch, seqlen, heads, dim)."""
    import torch

    dtype = torch.bfloat16 if problem.dtype == "bf16" else torch.float16
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(
        torch.randn(problem.batch, seqlen, heads, dim, device="cuda", dtype=dtype, generator=gen)
        for seqlen, heads, dim in (
            (problem.seqlen_q, problem.nheads_q, problem.head_dim),
            (problem.seqlen_k, problem.nheads_kv, problem.head_dim),
            (problem.seqlen_k, problem.nheads_kv, problem.head_dim_v),
        )
    )


def fa4tune_runner(problem, config, target, q, k, v):
    """A column running fa4tune's kernel with `config`: returns (O, LSE); `.poison()` fills both
    with NaN, so that an element the kernel does not write shows. Each column has its own outputs,
    so that one cannot pass on what another wrote."""
    import torch

    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward

    out = torch.empty(
        problem.batch,
        problem.seqlen_q,
        problem.nheads_q,
        problem.head_dim_v,
        dtype=q.dtype,
        device=q.device,
    )
    lse = torch.empty(
        problem.batch, problem.nheads_q, problem.seqlen_q, dtype=torch.float32, device=q.device
    )

    def run():
        attention_forward(q, k, v, config, causal=problem.causal, out=out, lse=lse, target=target)
        return out, lse

    def poison():
        out.fill_(float("nan"))
        lse.fill_(float("nan"))

    run.poison = poison
    return run


def runners_for(problem, default, tuned, target, q, k, v, kernel) -> dict:
    """name -> a callable returning O or (O, LSE), or a string saying why the column is empty: the
    default and the tuned config, then the kernel family's benchmark peers (flash-attn-4 with its
    LSE and without, cuDNN)."""
    from fa4tune.kernels import PeerUnavailable

    runners = {
        "default": fa4tune_runner(problem, default, target, q, k, v),
        "tuned": fa4tune_runner(problem, tuned, target, q, k, v),
    }
    for peer in kernel.peers():
        try:
            runners[peer.name] = peer.prepare(problem, q, k, v)
        except PeerUnavailable as exc:
            runners[peer.name] = str(exc)
    return runners


def measure_problem(problem, default, tuned, target, kernel, rounds: int) -> dict:
    q, k, v = random_inputs(problem, seed=0)
    runners = runners_for(problem, default, tuned, target, q, k, v, kernel)
    cells = verify_and_time(problem, runners, q, k, v, rounds)
    if (
        isinstance(cells.get(CUDNN), dict)
        and problem.nheads_q != problem.nheads_kv
        and not gqa_native(runners)
    ):
        cells[CUDNN]["note"] = "K/V heads repeated"
    return cells


def verify_and_time(problem, runners: dict, q, k, v, rounds: int) -> dict:
    """name -> cell: each runner (a callable returning O or (O, LSE), or a string saying why the
    column is empty) is checked against the fp32 reference on q, k, v first; one that raises or is
    wrong gets its reason as the cell and is not timed; the others are timed (time_interleaved)."""
    import torch

    from fa4tune.kernels.common.verify import TOLERANCES, compare, reference_slices

    references = reference_slices(q, k, v, problem.causal, None)

    def check(runner):
        if hasattr(runner, "poison"):  # fa4tune's columns: NaN first, so an unwritten element shows
            runner.poison()
        result = runner()
        o, lse = result if isinstance(result, tuple) else (result, None)
        torch.cuda.synchronize()
        return runner, compare(o, lse, references)

    return check_then_time(problem, runners, check, TOLERANCES[problem.dtype], rounds)


def check_then_time(problem, columns: dict, check, tolerance, rounds: int, flops=None) -> dict:
    """name -> cell. A column that is a string is its own cell (why it is empty); each other is
    checked first (`check(column)` -> (the callable to time, its family.Check)): one that raises or
    is wrong beyond `tolerance` gets its reason as the cell and is not timed; the others are timed
    (time_interleaved, TFLOP/s of `flops`) and their cells carry `out_error`, O's relative error
    against the fp32 reference."""
    cells, timed, errors = {}, {}, {}
    for name, column in columns.items():
        if isinstance(column, str):
            cells[name] = column
            continue
        try:
            run, result = check(column)
            wrong = result.verdict(tolerance)
        except Exception as exc:  # a column that cannot run this shape: say so in it
            cells[name] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
            continue
        if wrong:
            cells[name] = f"wrong ({wrong})"
            continue
        timed[name], errors[name] = run, result.out_error
    cells.update(time_interleaved(problem, timed, rounds, flops=flops))
    for name, error in errors.items():
        cells[name]["out_error"] = error
    return cells


def time_interleaved(problem, runners: dict, rounds: int, flops: float | None = None) -> dict:
    """name -> {ms, tflops, round_spread}: each runner timed in `rounds` interleaved rounds (a slow
    spell of the GPU hits one round of every column, not all rounds of one), the L2 flushed before
    every run; the median of the rounds' medians. TFLOP/s count `flops` (the forward's FLOPs of
    the problem unless given)."""
    from fa4tune.measure.timing import L2Flusher, round_order, time_cuda

    flusher, names = L2Flusher(), list(runners)
    medians = {name: [] for name in names}
    for round_index in range(rounds):
        for name in (names[index] for index in round_order(len(names), round_index)):
            medians[name].append(time_cuda(runners[name], flusher=flusher).median_ms)
    cells = {}
    for name, values in medians.items():
        ms = statistics.median(values)
        cells[name] = {
            "ms": ms,
            "tflops": (flops or problem.flops) / (ms * 1e-3) / 1e12,
            "round_spread": (max(values) - min(values)) / ms,
        }
    return cells


def gpu_target(prog: str):
    """The Target of the current GPU, or None after saying on stderr why there is none."""
    import torch

    from fa4tune.target import detect_target

    if not torch.cuda.is_available():
        print(f"{prog} needs an NVIDIA GPU", file=sys.stderr)
        return None
    target = detect_target()
    if target is None:
        print(f"{prog}: fa4tune has no target for {torch.cuda.get_device_name()}", file=sys.stderr)
    return target


def flush_text(header: dict) -> str:
    """What a report says of the L2 flush its runs were timed after: the header's mode, the dirty
    one (timing.UNRECORDED_FLUSH) in a JSON written before run_header recorded it."""
    from fa4tune.measure.timing import UNRECORDED_FLUSH

    return FLUSH_TEXT[header.get("flush", UNRECORDED_FLUSH)]


def run_header(kernel, rounds: int, **more) -> dict:
    """What a benchmark's report says it ran: the date, the GPU (its name and fa4tune's target for
    it, which the report's title names), torch, the CuTe DSL, flash-attn-4, the kernel family's
    source hash, the rounds and the L2 flush's mode (fa4tune.measure.timing.flush_mode), then
    `more`."""
    import torch

    from fa4tune.doctor import package_version
    from fa4tune.measure.timing import flush_mode
    from fa4tune.target import detect_target

    target = detect_target()
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "target": target.name if target is not None else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dsl": package_version("nvidia-cutlass-dsl") or "not installed",
        "fa4": package_version("flash-attn-4") or "not installed",
        "kernel_hash": kernel.source_hash(),
        "rounds": rounds,
        "flush": flush_mode(),
        **more,
    }


def measured_gpu(header: dict) -> str:
    """The GPU a report's title names: fa4tune's target for it (run_header), or its device name in
    a report written before run_header recorded the target."""
    return header.get("target", header["gpu"])


def write_report(text: str, out, prog: str) -> int:
    """A benchmark's markdown report, written to `out` whole or printed; exit code 0."""
    if out:
        from fa4tune.files import write_atomically

        write_atomically(Path(out), text)
        print(f"{prog}: wrote {out}", file=sys.stderr)
    else:
        print(text)
    return 0


def run_benchmark(
    argv,
    *,
    doc: str,
    prog: str,
    default_job: str,
    only_help: str,
    takes,
    measure,
    describe,
    render,
    record_job: bool = False,
) -> int:
    """The command line a job benchmark shares: --job, --rounds, --only, --json, --out, and
    --render (the report of an earlier --json, on any machine). Each problem of the job that
    `takes(problem)` accepts (and --only names) is measured by `measure(problem, target, kernel,
    rounds)`, one line of it (`describe(row)`) goes to stderr, and the JSON is rewritten after every
    problem, so that a run cut short keeps what it measured; then `render(rows, header)` is the
    report. Exit code 2 without a GPU target or with --rounds below 1."""
    import json

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--job", default=default_job)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", help=only_help)
    ap.add_argument("--json", help="write the cells here")
    ap.add_argument("--out", help="write the markdown report here (else print the table)")
    ap.add_argument("--render", metavar="JSON", help="only render the report of an earlier --json")
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        return write_report(render(saved["rows"], saved["header"]), args.out, prog)
    if args.rounds < 1:
        print(f"{prog}: --rounds must be at least 1", file=sys.stderr)
        return 2
    from fa4tune.kernels import get_kernel
    from fa4tune.tune.job import load_job

    target = gpu_target(prog)
    if target is None:
        return 2
    job = load_job(args.job)
    kernel = get_kernel(job.kernel.name)
    only = set(args.only.split(",")) if args.only else None
    header = run_header(kernel, args.rounds, **({"job": args.job} if record_job else {}))
    rows = []
    for problem in job.problems:
        if not takes(problem) or (only and problem.key() not in only):
            continue
        rows.append(measure(problem, target, kernel, args.rounds))
        print(f"{rows[-1]['key']}: {describe(rows[-1])}", file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"header": header, "rows": rows}, indent=1))
    return write_report(render(rows, header), args.out, prog)


def gqa_native(runners) -> bool:
    """Whether the cuDNN column ran grouped-query attention itself (else with K/V heads repeated,
    more memory traffic than the problem has)."""
    return getattr(runners.get(CUDNN), "gqa", {}).get("native", True)


# ---- the report ----------------------------------------------------------------------------------
def fmt_cell(cell) -> str:
    if isinstance(cell, dict):
        return f"{cell['tflops']:.0f}" + (f" ({cell['note']})" if cell.get("note") else "")
    return str(cell).replace("|", "/")


def ratio(cells, a: str, b: str) -> float | None:
    if isinstance(cells.get(a), dict) and isinstance(cells.get(b), dict):
        return cells[a]["tflops"] / cells[b]["tflops"]
    return None


def ratio_cells(cells) -> str:
    """The tuned column against default, flash-attn-4 and its O-only call, as table cells."""
    ratios = [ratio(cells, "tuned", other) for other in ("default", FA4, FA4_O)]
    return "".join(f" | {f'{x:.3f}' if x else '-'}" for x in ratios)


def geomean(values):
    values = [v for v in values if v is not None]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def render(rows, header: dict) -> str:
    grid = [r for r in rows if r["grid"] and r.get("cells")]
    vs_default = geomean(ratio(r["cells"], "tuned", "default") for r in grid)
    vs_fa4 = [ratio(r["cells"], "tuned", FA4) for r in grid]
    known_fa4 = [x for x in vs_fa4 if x is not None]
    known_fa4_o = [x for x in (ratio(r["cells"], "tuned", FA4_O) for r in grid) if x is not None]
    near = [r for r in rows if r.get("story", {}).get("to_near") is not None]
    within_40 = sum(r["story"]["to_near"] <= 40 for r in near)
    lines = [
        f"# Tuning report: {header['kernel']} on {header['target']}",
        "",
        f"Measured {header['date']} on {header['gpu']} "
        f"(driver {header['driver']}, CUDA {header['cuda']}); "
        f"torch {header['torch']}, nvidia-cutlass-dsl {header['dsl']}, "
        f"flash-attn-4 {header['fa4']}. "
        f"Kernel hash {header['kernel_hash'][:12]}; results DB `{header['db']}`. "
        + (
            f"Each column: {header['rounds']} interleaved rounds of "
            if header["rounds"] > 1
            else "Each column: one round (the columns one after another) of "
        )
        + "`fa4tune.measure.timing.time_cuda` "
        "(L2 flushed before every run, median of at least 20 runs)"
        + (", the median of the rounds" if header["rounds"] > 1 else "")
        + "; every column checked "
        "against the fp32 reference first (O, and LSE where a column returns it). "
        "TFLOP/s = 4·b·h·s_q·s_k·d (causal: unmasked pairs) / time. fa4tune writes O and LSE; "
        "`flash-attn-4` is called with `return_lse=True` to do the same, and "
        "`flash-attn-4, O only` as it runs by default (no LSE); cuDNN "
        "(torch SDPA without gradients) computes O only. Written by `benchmarks/tuning_report.py`. "
        + flush_text(header),
        "",
        "## Summary",
        "",
        f"- Tuned against default, geometric mean over the {len(grid)} grid problems: "
        + (f"**{vs_default:.3f}x** (target ≥ 1.05)" if vs_default else "not measured"),
        "- Tuned against flash-attn-4 (both writing O and LSE) on the grid: "
        + (
            f"lowest **{min(known_fa4):.3f}x**, "
            f"{sum(x >= 1.0 for x in known_fa4)} of {len(known_fa4)} shapes "
            "at or above 1.0 (target: all)"
            if known_fa4
            else "flash-attn-4 not measured"
        ),
        "- Tuned against flash-attn-4 computing O only: "
        + (
            f"lowest {min(known_fa4_o):.3f}x, "
            f"{sum(x >= 1.0 for x in known_fa4_o)} of {len(known_fa4_o)} shapes "
            "at or above 1.0"
            if known_fa4_o
            else "not measured"
        ),
        "- The search held a config within 2% of its final best after at most 40 measured "
        f"trials on {within_40} of {len(rows)} problems (target: all).",
        "",
        "## Per problem",
        "",
        "TFLOP/s per column; `tuned` changes only the knobs shown. Trials: measured candidates "
        "until the search first held a config within 2% of its final best / until it measured "
        "the config stored as best (of all it measured; stopped = cut short by the pruner).",
        "",
        "| problem | default config | tuned (changed knobs) | "
        + " | ".join(COLUMNS)
        + " | tuned / default | tuned / FA4 | tuned / FA4, O only | "
        "trials to 2% / to best (of) | search wall time |",
        "|" + "---|" * (len(COLUMNS) + 8),
    ]
    for r in rows:
        if not r.get("cells"):
            lines.append(
                f"| {r['key']} | {r.get('default', '')} | {r.get('note', 'not tuned')} |"
                + " |" * (len(COLUMNS) + 5)
            )
            continue
        s = r["story"]
        trials = (
            f"{s.get('to_near') or '-'} / {s.get('to_best') or '-'} ({s['measured']}"
            + (f", {s['stopped']} stopped" if s.get("stopped") else "")
            + ")"
        )
        lines.append(
            f"| {r['key']} | {r['default']} | {r['changed']} | "
            + " | ".join(fmt_cell(r["cells"].get(c, "")) for c in COLUMNS)
            + ratio_cells(r["cells"])
            + f" | {trials} | "
            f"{s.get('wall_s', 0):.0f} s |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", help="results DB (default: the job's db)")
    ap.add_argument(
        "--job", default="tuning_configs/h200-bf16.yaml", help="the problems, in report order"
    )
    ap.add_argument("--out", default="docs/tuning-report.md")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        text = build(args)
    except ReportError as exc:
        print(f"tuning_report: error: {exc}", file=sys.stderr)
        return 2
    from fa4tune.files import write_atomically

    write_atomically(Path(args.out), text)
    print(f"tuning_report: wrote {args.out}")
    return 0


def build(args) -> str:
    import torch

    from fa4tune.cli import config_text
    from fa4tune.db import ResultsDB
    from fa4tune.doctor import package_version
    from fa4tune.errors import Fa4tuneError
    from fa4tune.kernels import get_kernel
    from fa4tune.measure.gpu import GpuOptions, artifact_dir
    from fa4tune.target import detect_target
    from fa4tune.tune.job import load_job

    if not torch.cuda.is_available():
        raise ReportError("needs an NVIDIA GPU (the report measures every column on it)")
    target = detect_target()
    if target is None:
        raise ReportError(f"fa4tune has no target for {torch.cuda.get_device_name()}")
    if args.rounds < 1:
        raise ReportError("--rounds must be at least 1")
    try:
        job = load_job(args.job)
        args.db = args.db or job.db
        if not args.db:
            raise ReportError(f"{args.job} names no db: pass --db")
        db = ResultsDB.open(args.db, create=False)
    except Fa4tuneError as exc:
        raise ReportError(str(exc)) from None
    kernel = get_kernel(job.kernel.name)
    installed = kernel.source_hash()
    best = {
        e.problem_key: e
        for e in db.best_configs(kernel=kernel.name, kernel_hash=installed, target=target.name)
    }
    if not best:
        raise ReportError(
            f"{args.db} has no best configs of {kernel.name} (installed hash {installed[:12]}) on "
            f"{target.name}: run `fa4tune search {args.job}` first"
        )
    runs = [r for r in db.runs() if r["kernel_hash"] == installed and r["target"] == target.name]
    # The search exported every kernel it measured: load those (milliseconds) instead of compiling
    # again.
    dsl = package_version("nvidia-cutlass-dsl")
    artifacts = artifact_dir(GpuOptions.parse(job.measure).kernel_cache(), dsl, kernel)
    last = runs[-1] if runs else {}
    header = {
        "kernel": kernel.name,
        "target": target.name,
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "driver": last.get("nvidia_driver") or "?",
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "dsl": dsl or "not installed",
        "fa4": package_version("flash-attn-4") or "not installed",
        "kernel_hash": installed,
        "db": args.db,
        "rounds": args.rounds,
    }
    rows = []
    for problem in job.problems:
        key = problem.key()
        default = kernel.default_config(problem, target)
        row = {"key": key, "grid": is_grid(problem), "default": default.short()}
        entry = best.get(key)
        if entry is None:
            row["note"] = "not tuned (no best config in the DB)"
            rows.append(row)
            continue
        tuned = kernel.config(entry.config)
        row["loaded"] = sum(
            preload(artifacts, kernel, config, problem, target) for config in {default, tuned}
        )
        row["changed"] = config_text(entry.config, default.to_dict())
        row["story"] = search_story(db, key, entry)
        row["cells"] = measure_problem(problem, default, tuned, target, kernel, args.rounds)
        print(
            f"{key}: "
            + ", ".join(f"{c} {fmt_cell(row['cells'].get(c, ''))}" for c in COLUMNS)
            + f" ({row['loaded']} kernels loaded from the search's exports)",
            file=sys.stderr,
            flush=True,
        )
        rows.append(row)
    db.close()
    return render(rows, header)


if __name__ == "__main__":
    raise SystemExit(main())
