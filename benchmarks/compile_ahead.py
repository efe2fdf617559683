"""Does compiling ahead shorten a search? Runs the same small gpu-backend search twice, with the
compile pool off and on, and prints the wall times. Compiles are real (CuTe DSL, sm_90a, no GPU
needed); the GPU's part of a candidate is simulated by sleeping --gpu-seconds, so this runs on any
machine, and on the H200's host it measures that host's compile throughput.

    python benchmarks/compile_ahead.py [--configs 8] [--gpu-seconds 1.0] [--workers 1]

This file is also the worker module of those searches: describe() claims an H200, compile is the
real one of fa4tune.measure.gpu_worker, measure() loads the compile worker's object file (or
compiles) and then sleeps."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fa4tune.measure.gpu_worker import compile  # noqa: E402,F401 - the compile workers' op

TILE_NS = (64, 80, 96, 112, 128, 144, 160, 176, 192)


def describe(state: dict) -> dict:
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    return {
        "role": os.environ.get("FA4TUNE_WORKER_ROLE"),
        "gpu_name": "simulated H200",
        "target": "H200",
        "sm_count": 132,
    }


def clocks(request: dict, channel, state: dict) -> dict:
    return {}


def measure(request: dict, channel, state: dict) -> dict:
    from fa4tune.measure.gpu_worker import _candidate, _kernel

    problem, config, target = _candidate(request)
    _, compile_s, compiled_by = _kernel(request, problem, config, target)
    channel.phase("run")
    time.sleep(float(os.environ["SIMULATED_GPU_SECONDS"]))
    return {
        "status": "ok",
        "time_ms": 1.0 + config.tile_n / 1000,
        "spread": 0.01,
        "out_error": 1e-3,
        "lse_error": 1e-4,
        "compile_s": compile_s,
        "compiled_by": compiled_by,
    }


def search_seconds(configs: int, workers: int, cache: str) -> tuple[float, dict]:
    from fa4tune.db import ResultsDB
    from fa4tune.tune.job import parse_job
    from fa4tune.tune.search import run_search

    job = parse_job(
        {
            "name": f"compile-ahead-{workers}",
            "backend": "gpu",
            "spaces": {"tiles": {"tile_m": [128], "tile_n": list(TILE_NS[:configs])}},
            "problems": [{"head_dim": 128, "seqlen_q": 4096, "batch": 4, "nheads_q": 16}],
            "sampler": "grid",
            "budget": {"trials": configs},
            "warm_start": 0,
            "measure": {
                "worker_module": "compile_ahead",
                "compile_workers": workers,
                "cache_dir": cache,
                "prune_margin": None,
                "confirm_top": 1,
                "confirm_rounds": 1,
            },
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        db = str(Path(tmp) / "results.db")
        started = time.monotonic()
        run_search(job, db=db, say=lambda *a: None)
        seconds = time.monotonic() - started
        with ResultsDB.open(db, create=False) as results:
            trials = [t for t in results.trials() if t["source"] != "confirm"]
    by = {}
    for t in trials:
        how = t["details"].get("compiled_by", "?").split(" ")[0]
        by[how] = by.get(how, 0) + 1
    return seconds, by


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--configs",
        type=int,
        default=8,
        help=f"candidates (distinct kernels), at most {len(TILE_NS)}",
    )
    ap.add_argument(
        "--gpu-seconds", type=float, default=1.0, help="simulated GPU time per candidate"
    )
    ap.add_argument("--workers", type=int, default=1, help="compile workers in the 'on' run")
    args = ap.parse_args(argv)
    os.environ["SIMULATED_GPU_SECONDS"] = str(args.gpu_seconds)
    print(
        f"{args.configs} candidates, simulated GPU time {args.gpu_seconds:g} s each, "
        f"{os.cpu_count()} CPUs"
    )
    for workers in (0, args.workers):
        with tempfile.TemporaryDirectory() as cache:  # a cold kernel cache for each run
            seconds, by = search_seconds(args.configs, workers, cache)
        print(
            f"compile workers {workers}: search {seconds:.1f} s "
            f"({seconds / args.configs:.2f} s per candidate); "
            f"kernels from: {by}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
