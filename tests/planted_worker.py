"""A worker module for the gpu backend's CPU tests (measure: {worker_module: planted_worker}).

It claims to be an H200 and "measures" with the cost model, except for planted candidates, chosen by
tile_n, that do what a bad kernel does to a real worker: crash it, end it, hang it, raise a device
error, or give wrong results at a tempting speed. PLANTED_DELAY (seconds) slows every measurement so
that a test can kill a search in the middle; once the file PLANTED_GPU_DOWN names exists, every run
crashes, as on a GPU that has gone bad; with PLANTED_HANG_PID_FILE set, every run writes the
worker's pid to that file and hangs."""

from __future__ import annotations

import os
import signal
import time

SEGFAULT_TILE_N = 96  # killed by SIGSEGV while running (an illegal address does this to a process)
EXIT_TILE_N = 80  # os._exit(3) while compiling
HANG_TILE_N = 112  # never returns from the run
DEVICE_ERROR_TILE_N = 176  # raises after the run began (a CUDA error): the worker must be replaced
WRONG_TILE_N = 144  # 'measures' fastest of all, with an output error far above tolerance
COMPILE_ERROR_TILE_N = 192  # raises while compiling: a failed candidate, the worker stays
POOL_CRASH_TILE_N = 160  # the compile worker dies on it
POOL_HANG_TILE_N = 176  # the compile worker never finishes it


def describe(state: dict) -> dict:
    if os.environ.get("FA4TUNE_WORKER_ROLE") == "compile":
        if os.environ.get("PLANTED_POOL_DOWN"):  # no compile worker can start (no DSL there, say)
            raise RuntimeError("planted: the compile worker cannot start")
        return {"role": "compile", "pid": os.getpid()}
    return {
        "role": "measure",
        "pid": os.getpid(),
        "gpu_name": "planted H200 (CPU test)",
        "target": "H200",
        "sm_count": 132,
        "cuda_version": "12.8",
        "cuda_driver": "12.8",
        "nvidia_driver": "planted",
        "clocks": {"sm_mhz": 1980.0, "mem_mhz": 3201.0},
    }


def clocks(request: dict, channel, state: dict) -> dict:
    return {"clocks": {"sm_mhz": 1970.0, "mem_mhz": 3201.0}}


def compile(request: dict, channel, state: dict) -> dict:  # noqa: A001
    if request["config"]["tile_n"] == POOL_CRASH_TILE_N:
        os._exit(4)
    if request["config"]["tile_n"] == POOL_HANG_TILE_N:
        time.sleep(3600)
    os.makedirs(os.path.dirname(request["artifact"]), exist_ok=True)
    with open(request["artifact"], "w") as f:
        f.write(repr(request["config"]))
    return {"artifact": request["artifact"], "compile_s": 0.01}


def measure(request: dict, channel, state: dict) -> dict:
    from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
    from fa4tune.kernels.fa4_fwd_sm90.cost_model import CostModel
    from fa4tune.problem import Problem
    from fa4tune.target import get_target

    config = request["config"]
    tile_n = config["tile_n"]
    state["served"] = state.get("served", 0) + 1
    if tile_n == EXIT_TILE_N:
        os._exit(3)
    if tile_n == COMPILE_ERROR_TILE_N:
        raise ValueError("planted compile error")
    channel.phase("run")
    delay = float(os.environ.get("PLANTED_DELAY", "0"))
    if delay:
        time.sleep(delay)
    if tile_n == SEGFAULT_TILE_N or os.path.exists(os.environ.get("PLANTED_GPU_DOWN") or "\0"):
        os.kill(
            os.getpid(), signal.SIGSEGV
        )  # (PLANTED_GPU_DOWN: a file that, once made, crashes every run)
    hang_pid_file = os.environ.get("PLANTED_HANG_PID_FILE")
    if hang_pid_file:
        with open(f"{hang_pid_file}.part", "w") as f:
            f.write(str(os.getpid()))
        os.replace(f"{hang_pid_file}.part", hang_pid_file)  # whole, or not there
    if tile_n == HANG_TILE_N or hang_pid_file:
        time.sleep(3600)
    if tile_n == DEVICE_ERROR_TILE_N:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    seconds, _ = CostModel(get_target("H200")).time_s(
        FwdConfig.from_dict(config), Problem.from_dict(request["problem"])
    )
    time_ms = seconds * 1e3
    out_error = 1e-3
    if tile_n == WRONG_TILE_N:
        time_ms, out_error = time_ms * 0.25, 0.5
    result = {
        "pid": os.getpid(),
        "served": state["served"],
        "out_error": out_error,
        "lse_error": 1e-4,
        "artifact_seen": bool(request.get("artifact")) and os.path.exists(request["artifact"]),
        "seed": request["seed"],
        "mode": request["mode"],
    }
    if request["mode"] == "search":
        stop = channel.ask({"cheap_ms": time_ms})
        if stop:
            return {
                **result,
                "status": "stopped",
                "reason": stop,
                "time_ms": time_ms,
                "spread": 0.05,
            }
    return {**result, "status": "ok", "time_ms": time_ms, "spread": 0.01, "runs": 20}
