"""Wall time of one search job on 1 GPU against N GPUs (one worker process per GPU, sharing each
problem's study), and the best configs each found. Prints a table; never passes or fails. The target
(issue 5) is at least 1.8x faster on 2 GPUs with the same best configs.

    python benchmarks/multi_gpu.py --gpus 0,1 [--job tuning_configs/h200-bf16.yaml] [--problems 4]

Both runs search the same problems with the same trial budget per problem; the job's time budget is
lifted (trials only), or with a time budget the run on N GPUs would simply measure N times as many
candidates in the same wall time. Each run gets a fresh results DB and journal under --out, and
nothing is exported. The 1-GPU run goes through the same worker process (--gpus FIRST), so process
start-up is paid by both. The best configs of a problem can differ between runs (the searches sample
differently) while their times agree within noise: the table shows both, and their ratio.

On a CPU the script runs on the cost model, to try it: --backend model --workers 2. With --simulate
the gpu backend runs as on GPUs, but its worker processes sleep for each phase instead of running a
kernel (benchmarks/simulated_gpu_worker.py, phase times measured on the H200): the search's own
machinery timed on a CPU, e.g. --simulate --gpus 0,1 with the whole job.

For each run the script also prints, per worker process, how much of the wall time it had a trial
of some problem in flight (from the Optuna journal); the rest is start-up, confirmations and
waits."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(REPO))


def derived_job(
    job_path: Path,
    problems: int | None,
    trials: int | None,
    keep_time_budget: bool,
    backend: str | None,
) -> dict:
    """The job to time: its first `problems` problems (as explicit problems), trials only, no
    export."""
    from fa4tune.tune.job import load_job

    job = load_job(job_path)
    data = yaml.safe_load(job.text)
    data["name"] = f"{job.name}-multi-gpu"
    data["problems"] = [p.to_dict() for p in job.problems[:problems]]
    budget = {"trials": trials or job.budget.trials or 40}
    if keep_time_budget and job.budget.seconds:
        budget["seconds"] = job.budget.seconds
    data["budget"] = budget
    for key in ("export", "db", "storage"):
        data.pop(key, None)
    if backend:
        data["backend"] = backend
    return data


def run(tag: str, job_file: Path, out: Path, placement: list[str], simulate: bool = False) -> float:
    """One search; its wall time in seconds. Its output goes to OUT/TAG.log. Each run compiles into
    an empty kernel cache of its own (OUT/TAG-kernels), so the second run does not load what the
    first compiled."""
    entry = [str(BENCHMARKS / "simulated_gpus.py")] if simulate else ["-m", "fa4tune.cli"]
    command = [
        sys.executable,
        *entry,
        "search",
        str(job_file),
        "--db",
        str(out / f"{tag}.db"),
        "--storage",
        str(out / f"{tag}.journal"),
        "--no-progress",
        *placement,
    ]
    cache = out / f"{tag}-kernels"
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "FA4TUNE_KERNEL_CACHE": str(cache)}
    if simulate:  # the workers import the simulated worker module by name
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(BENCHMARKS), str(REPO), env.get("PYTHONPATH")) if p
        )
    print(f"{tag}: {' '.join(command[2:])}", flush=True)
    started = time.monotonic()
    with open(out / f"{tag}.log", "w") as log:
        code = subprocess.call(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    seconds = time.monotonic() - started
    if code != 0:
        sys.exit(f"{tag} failed with exit status {code}; see {out / f'{tag}.log'}")
    return seconds


def best_configs(db_path: Path) -> dict:
    """problem key -> (ms, config, measured trials) of the run's kernel."""
    from fa4tune.db import ResultsDB

    with ResultsDB.open(str(db_path), create=False) as db:
        studies = {t["problem_key"]: t["study_name"] for t in db.trials()}
        return {
            e.problem_key: (e.time_ms, e.config, db.count_trials(studies[e.problem_key]))
            for e in db.best_configs()
        }


def worker_activity(journal: Path, wall_s: float) -> list[str]:
    """Per worker process: the seconds during which it had a trial of some problem in flight (asked
    and not yet told, which includes compiling ahead), out of the run's wall time."""
    import optuna

    from fa4tune.tune.studies import WORKER_ATTR, open_storage

    storage = open_storage(str(journal))
    spans: dict[str, list[tuple[float, float]]] = {}
    for summary in optuna.study.get_all_study_summaries(storage):
        study = optuna.load_study(study_name=summary.study_name, storage=storage)
        for trial in study.get_trials(deepcopy=False):
            worker = trial.user_attrs.get(WORKER_ATTR)
            if worker and trial.datetime_start and trial.datetime_complete:
                spans.setdefault(worker, []).append(
                    (trial.datetime_start.timestamp(), trial.datetime_complete.timestamp())
                )
    lines = []
    for worker, intervals in sorted(spans.items()):
        intervals.sort()
        busy, end = 0.0, None
        for start, stop in intervals:  # the union of the intervals
            if end is None or start > end:
                busy += stop - start
                end = stop
            elif stop > end:
                busy += stop - end
                end = stop
        lines.append(
            f"worker {worker}: a trial in flight {busy:.1f} s of {wall_s:.1f} s "
            f"({busy / wall_s:.0%}), {len(intervals)} trials"
        )
    return lines


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", type=Path, default=REPO / "tuning_configs" / "h200-bf16.yaml")
    parser.add_argument(
        "--gpus", default="0,1", help="the GPUs of the many-GPU run; the 1-GPU run uses the first"
    )
    parser.add_argument("--problems", type=int, help="only the job's first N problems")
    parser.add_argument(
        "--trials", type=int, help="measured trials per problem (default: the job's)"
    )
    parser.add_argument(
        "--keep-time-budget", action="store_true", help="keep the job's seconds per problem"
    )
    parser.add_argument("--backend", choices=["gpu", "model"], help="override the job's backend")
    parser.add_argument(
        "--workers", type=int, help="model backend: N CPU workers instead of --gpus"
    )
    parser.add_argument("--out", type=Path, default=REPO / "fa4tune-results" / "multi-gpu")
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="gpu backend with simulated GPUs (sleeps): times the search's machinery on a CPU",
    )
    parser.add_argument(
        "--compile-workers",
        type=int,
        help=(
            "compile processes per worker (default: the job's; with --simulate 8, as on a GPU host)"
        ),
    )
    args = parser.parse_args(argv)
    if args.simulate and (args.workers is not None or args.backend == "model"):
        parser.error(
            "--simulate runs the gpu backend on simulated GPUs: "
            "give --gpus, not --workers or --backend"
        )

    args.out.mkdir(parents=True, exist_ok=True)
    for old in args.out.glob("*"):
        if old.suffix in (".db", ".journal", ".log", ".flock", ".yaml") or old.name.endswith(
            ("-wal", "-shm")
        ):
            old.unlink()
    job_file = args.out / "job.yaml"
    timed = derived_job(
        args.job,
        args.problems,
        args.trials,
        args.keep_time_budget,
        "gpu" if args.simulate else args.backend,
    )
    measure = dict(timed.get("measure") or {})
    if args.simulate:
        measure["worker_module"] = "simulated_gpu_worker"
        # "auto" would size the pool by this machine's CPUs; a GPU host has many (8 per worker).
        measure["compile_workers"] = 8 if args.compile_workers is None else args.compile_workers
    elif args.compile_workers is not None:
        measure["compile_workers"] = args.compile_workers
    if measure:
        timed["measure"] = measure
    job_file.write_text(yaml.safe_dump(timed, sort_keys=False))
    if args.workers is not None:
        many, one, label = (
            ["--workers", str(args.workers)],
            ["--workers", "1"],
            f"{args.workers} workers",
        )
    else:
        gpus = args.gpus.split(",")
        many, one, label = ["--gpus", args.gpus], ["--gpus", gpus[0]], f"{len(gpus)} GPUs"
    single_s = run("one", job_file, args.out, one, args.simulate)
    many_s = run("many", job_file, args.out, many, args.simulate)

    from fa4tune.cli import config_text

    single, multi = best_configs(args.out / "one.db"), best_configs(args.out / "many.db")
    rows = [
        [
            "problem",
            "1: best ms",
            "1: trials",
            f"{label}: best ms",
            f"{label}: trials",
            f"{label} config vs 1",
            "time ratio",
        ]
    ]
    same = 0
    for key in sorted(set(single) | set(multi)):
        a, b = single.get(key), multi.get(key)
        if a is None or b is None:
            rows.append(
                [
                    key,
                    f"{a[0]:.4g}" if a else "-",
                    str(a[2]) if a else "-",
                    f"{b[0]:.4g}" if b else "-",
                    str(b[2]) if b else "-",
                    "missing",
                    "-",
                ]
            )
            continue
        same += a[1] == b[1]
        rows.append(
            [
                key,
                f"{a[0]:.4g}",
                str(a[2]),
                f"{b[0]:.4g}",
                str(b[2]),
                config_text(b[1], a[1], unchanged="same"),
                f"{b[0] / a[0]:.3f}",
            ]
        )
    print()
    print(table(rows))
    print()
    print(
        f"wall time: 1 = {single_s:.1f} s, {label} = {many_s:.1f} s, "
        f"speedup {single_s / many_s:.2f}x "
        f"(target 1.8x on 2 GPUs); same best config on {same} of {len(rows) - 1} problems"
    )
    for tag, seconds in (("one", single_s), ("many", many_s)):
        for line in worker_activity(args.out / f"{tag}.journal", seconds):
            print(f"{tag}: {line}")
    if args.simulate:
        print(
            "simulated GPUs (benchmarks/simulated_gpu_worker.py): "
            "the search's machinery, not kernels"
        )
    print(f"logs, DBs and the timed job: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
