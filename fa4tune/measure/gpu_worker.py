"""What the gpu backend's worker processes run (see worker.py for the protocol).

The measuring worker owns the GPU: it keeps compiled kernels (the kernel family's compile cache),
the inputs of the current problem and the L2 flush buffer from one candidate to the next. Per
candidate: get the kernel (load the object file a compile worker exported, else compile), run it
once on fresh random inputs with NaN-poisoned outputs and compare against the family's fp32
reference, time it cheaply and let the parent's pruner stop it, time it fully, and check the output
of a run after the timed runs again (a race shows up under repetition). Everything about the
kernel comes from its family (fa4tune/kernels/family.py), named in the request. Compile workers only
compile and export; they never see the GPU.

FA4TUNE_WORKER_ROLE says which of the two a process is."""

from __future__ import annotations

import os
import subprocess
import time

from ..doctor import cuda_driver_version, package_version
from ..kernels import get_kernel
from ..kernels.family import Tolerance
from ..target import Target, get_target, target_for_device_name
from . import timing

ROLE_VARIABLE = "FA4TUNE_WORKER_ROLE"
CHEAP_TIMING = {"warmup_ms": 25.0, "min_runs": 5, "max_runs": 10, "target_ms": 25.0}
# The GPU runs candidate after candidate, so its clocks are already up: 50 ms of warm-up, then
# 200 ms of timed runs (20-200, each after an L2 flush). Each measurement records its spread, and
# the best few are timed again in interleaved rounds before one is stored.
FULL_TIMING = {"warmup_ms": 50.0, "min_runs": 20, "max_runs": 200, "target_ms": 200.0}


# ---- start-up -----------------------------------------------------------------------------------
def describe(state: dict) -> dict:
    if os.environ.get(ROLE_VARIABLE) == "compile":
        state["role"] = "compile"
        return {"role": "compile", "pid": os.getpid()}
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU is visible to the measuring worker")
    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    target = target_for_device_name(props.name, props.multi_processor_count)
    if target is not None:
        os.environ.setdefault("CUTE_DSL_ARCH", target.arch)
    torch.cuda.init()
    state.update(role="measure", device=device, target=target, pci_bus=_pci_bus(props))
    return {
        "role": "measure",
        "pid": os.getpid(),
        "gpu_name": props.name,
        "target": target.name if target else None,
        "sm_count": props.multi_processor_count,
        "compute_capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "cuda_version": torch.version.cuda,
        "cuda_driver": cuda_driver_version(),
        "torch_version": torch.__version__,
        "dsl_version": package_version("nvidia-cutlass-dsl"),
        **gpu_clocks(state),
    }


def _pci_bus(props) -> str | None:
    try:
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except AttributeError:
        return None


SMI_FIELDS = (
    "driver_version",
    "clocks.sm",
    "clocks.mem",
    "clocks.max.sm",
    "clocks.max.mem",
    "temperature.gpu",
    "power.draw",
)


def gpu_clocks(state: dict) -> dict:
    """The NVIDIA driver version and the clocks the GPU runs at now (nvidia-smi, by PCI bus so that
    CUDA_VISIBLE_DEVICES cannot confuse the index). Empty when nvidia-smi is not there."""
    command = ["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits"]
    if state.get("pci_bus"):
        command += ["-i", state["pci_bus"]]
    try:
        line = subprocess.run(
            command, capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in line.strip().splitlines()[0].split(",")] if line.strip() else []
    if len(values) != len(SMI_FIELDS):
        return {}

    def number(text):
        try:
            return float(text)
        except ValueError:
            return None

    return {
        "nvidia_driver": values[0],
        "clocks": {
            "sm_mhz": number(values[1]),
            "mem_mhz": number(values[2]),
            "max_sm_mhz": number(values[3]),
            "max_mem_mhz": number(values[4]),
            "temperature_c": number(values[5]),
            "power_w": number(values[6]),
            "at": time.time(),
        },
    }


# ---- requests -----------------------------------------------------------------------------------
def clocks(request: dict, channel, state: dict) -> dict:
    return gpu_clocks(state)


def compile(request: dict, channel, state: dict) -> dict:  # noqa: A001 - the op's name
    """Compile a candidate and export it to request["artifact"] (skipped when it already exists)."""
    path = request["artifact"]
    if os.path.exists(path):
        return {"artifact": path, "compile_s": 0.0, "reused": True}
    family, problem, config, target = _candidate(request)
    compiled = family.compile(problem, config, target)
    family.export(compiled, path)
    return {"artifact": path, "compile_s": compiled.compile_seconds, "reused": False}


def measure(request: dict, channel, state: dict) -> dict:
    """Verify and time one candidate. request: kernel, problem, config, target, mode ("search":
    cheap timing and the parent's verdict before the full one; "retime": full timing only), seed,
    tolerance, timing options, artifact (optional)."""
    import torch

    family, problem, config, target = _candidate(request)
    compiled, compile_s, compiled_by = _kernel(request, family, problem, config, target)
    channel.phase("run")
    case = _case(family, problem, state)
    if "flusher" not in state:
        state["flusher"] = timing.L2Flusher(torch.device("cuda", state.get("device", 0)))
    flusher = state["flusher"]
    tolerance = Tolerance(**request["tolerance"])

    # Fresh random inputs for every candidate, outputs poisoned so that an unwritten element shows.
    family.randomize(case, int(request.get("seed", 0)))
    run = family.launcher(case, config, target)
    references = family.reference(case)
    check = poisoned_check(run, family, case, references, torch.cuda.synchronize)
    result = {
        "compile_s": compile_s,
        "compiled_by": compiled_by,
        "out_error": check.out_error,
        "lse_error": check.lse_error,
    }
    wrong = check.verdict(tolerance)
    if wrong:
        return {**result, "status": "wrong", "reason": wrong}
    options = request.get("timing", {})
    if request.get("mode", "search") == "search":
        cheap = timing.time_cuda(
            run, flusher=flusher, **{**CHEAP_TIMING, **options.get("cheap", {})}
        )
        result.update(cheap_ms=cheap.median_ms, cheap_spread=cheap.spread, cheap_runs=cheap.runs)
        stop = channel.ask({"cheap_ms": cheap.median_ms})
        if stop:
            return {
                **result,
                "status": "stopped",
                "reason": stop,
                "time_ms": cheap.median_ms,
                "spread": cheap.spread,
                "runs": cheap.runs,
            }
    full = timing.time_cuda(run, flusher=flusher, **{**FULL_TIMING, **options.get("full", {})})
    # Once more after the timed runs: they write the same values as the first, so without the poison
    # a kernel whose later launches write nothing (state an earlier launch left behind, a tile
    # counter not reset to zero) would pass on the first run's output, and time at next to nothing.
    after = poisoned_check(run, family, case, references, torch.cuda.synchronize)
    wrong = after.verdict(tolerance)
    if wrong:
        return {**result, "status": "wrong", "reason": f"after {full.runs} timed runs: {wrong}"}
    result.update(
        out_error=max(check.out_error, after.out_error),
        lse_error=max(check.lse_error, after.lse_error),
    )
    return {
        **result,
        "status": "ok",
        "time_ms": full.median_ms,
        "spread": full.spread,
        "runs": full.runs,
        "min_ms": full.min_ms,
    }


def poisoned_check(run, family, case, references, synchronize):
    """Poison the outputs (NaN), run once and compare with the references: an element the run does
    not write shows as NaN."""
    synchronize()
    family.poison(case)
    run()
    synchronize()
    return family.compare(case, references)


def _candidate(request: dict):
    """(family, problem, config, target) of a request."""

    family = get_kernel(request.get("kernel"))
    target = request["target"]  # the whole description: a device's own SM count is not its model's
    return (
        family,
        family.problem(request["problem"]),
        family.config(request["config"]),
        Target(**target) if isinstance(target, dict) else get_target(target),
    )


def _kernel(request: dict, family, problem, config, target):
    """(compiled kernel, seconds, how): loaded from the compile worker's object file when there is
    one, else compiled here (also when the object file cannot be loaded)."""
    artifact = request.get("artifact")
    how = "worker"
    if artifact:
        try:
            compiled = family.load(artifact, problem, config, target)
            return compiled, compiled.compile_seconds, "pool"
        except Exception as exc:  # noqa: BLE001 - fall back to compiling here, and say why
            how = (
                f"worker (loading {os.path.basename(artifact)} failed: {type(exc).__name__}: {exc})"
            )[:300]
    start = time.perf_counter()
    compiled = family.compile(problem, config, target)
    return compiled, time.perf_counter() - start, how


def _case(family, problem, state: dict):
    """The problem's inputs and outputs on the device, kept while the problem stays the same."""
    import torch

    key = (family.name, problem.key())
    cached = state.get("case")
    if cached is not None and cached[0] == key:
        return cached[1]
    state.pop("case", None)
    torch.cuda.empty_cache()
    case = family.measurement_case(problem, torch.device("cuda", state.get("device", 0)))
    state["case"] = (key, case)
    return case
