"""A gpu-backend worker module whose GPU is simulated: `compile` and `measure` sleep for the times
the phases took on the H200 instead of running anything, and the measured time is the cost model's.

`benchmarks/multi_gpu.py --simulate` runs a search with it (job option `measure.worker_module`) to
time the search's own machinery (worker processes, shared studies, compile-ahead pool, confirmation)
on a machine without GPUs. The default sleeps are medians of the first H200 search of kernel
cece5b380f8f (hdim 64, 4k): a compile in the pool 1.5 s, a candidate stopped after its cheap timing
0.22 s, one measured fully 0.8 s; a confirmation round's re-timing is taken as the full timing's
0.8 s too (an upper bound). Override with FA4TUNE_SIM_COMPILE_S, FA4TUNE_SIM_CHEAP_S,
FA4TUNE_SIM_FULL_S."""

from __future__ import annotations

import os
import time

SIMULATED_GPU = "simulated H200 (no GPU: sleeps)"


def _seconds(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def describe(state: dict) -> dict:
    if os.environ.get("FA4TUNE_WORKER_ROLE") == "compile":
        return {"role": "compile", "pid": os.getpid()}
    return {
        "role": "measure",
        "pid": os.getpid(),
        "gpu_name": SIMULATED_GPU,
        "target": "H200",
        "sm_count": 132,
        "cuda_version": "simulated",
        "cuda_driver": "simulated",
        "nvidia_driver": "simulated",
        "clocks": {"sm_mhz": 1980.0, "mem_mhz": 3201.0},
    }


def clocks(request: dict, channel, state: dict) -> dict:
    return {"clocks": {"sm_mhz": 1980.0, "mem_mhz": 3201.0}}


def compile(request: dict, channel, state: dict) -> dict:  # noqa: A001 - the protocol's op name
    path = request["artifact"]
    if os.path.exists(path):
        return {"artifact": path, "compile_s": 0.0, "reused": True}
    seconds = _seconds("FA4TUNE_SIM_COMPILE_S", 1.5)
    time.sleep(seconds)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(repr(request["config"]))
    return {"artifact": path, "compile_s": seconds, "reused": False}


def measure(request: dict, channel, state: dict) -> dict:
    from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
    from fa4tune.kernels.fa4_fwd_sm90.cost_model import CostModel
    from fa4tune.problem import Problem
    from fa4tune.target import get_target

    artifact = request.get("artifact")
    compile_s = 0.0
    if not (artifact and os.path.exists(artifact)):  # not compiled ahead: compiled here
        compile_s = _seconds("FA4TUNE_SIM_COMPILE_S", 1.5)
        time.sleep(compile_s)
    channel.phase("run")
    seconds, _ = CostModel(get_target("H200")).time_s(
        FwdConfig.from_dict(request["config"]), Problem.from_dict(request["problem"])
    )
    time_ms = seconds * 1e3
    result = {"compile_s": compile_s, "out_error": 1e-3, "lse_error": 1e-4}
    if request.get("mode", "search") == "search":
        time.sleep(_seconds("FA4TUNE_SIM_CHEAP_S", 0.22))
        stop = channel.ask({"cheap_ms": time_ms})
        if stop:
            return {
                **result,
                "status": "stopped",
                "reason": stop,
                "time_ms": time_ms,
                "spread": 0.02,
                "runs": 10,
            }
    time.sleep(_seconds("FA4TUNE_SIM_FULL_S", 0.8))
    return {**result, "status": "ok", "time_ms": time_ms, "spread": 0.01, "runs": 20}
