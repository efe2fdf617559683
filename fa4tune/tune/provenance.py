"""What a search records of where its numbers come from: the versions of the packages that built
and ran the kernel, the GPU fields of a run, the L2 flush its times were taken under, and the
provenance stored with a best config. The search process and each worker process record the same
fields."""

from __future__ import annotations

from importlib import metadata

import fa4tune

from ..measure.timing import NO_FLUSH, UNRECORDED_FLUSH, flush_mode

# What a run records of the GPU it measures on (filled in by the GPU workers when they start).
RUN_GPU_FIELDS = ("gpu_name", "sm_count", "cuda_driver", "nvidia_driver", "cuda_version", "clocks")


def versions() -> dict:
    """The versions of the CuTe DSL, torch and fa4tune in this environment (None: not installed)."""

    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {
        "dsl_version": version("nvidia-cutlass-dsl"),
        "torch_version": version("torch"),
        "fa4tune_version": fa4tune.__version__,
    }


def run_gpu_fields(provenance: dict) -> dict:
    """The RUN_GPU_FIELDS of a backend's provenance (None where it has none)."""
    return {k: provenance.get(k) for k in RUN_GPU_FIELDS}


def l2_flush(is_estimate: bool) -> str:
    """The L2 flush a search's times are taken under: timing.flush_mode() (FA4TUNE_L2_FLUSH), or
    timing.NO_FLUSH for estimates (the variable is then not read)."""
    return NO_FLUSH if is_estimate else flush_mode()


def run_l2_flush(run: dict) -> str:
    """The L2 flush a stored run's times were taken under (its details' `l2_flush`); a run without
    the record: timing.NO_FLUSH for estimates, else timing.UNRECORDED_FLUSH."""
    recorded = (run.get("details") or {}).get("l2_flush")
    if recorded:
        return recorded
    return NO_FLUSH if run["is_estimate"] else UNRECORDED_FLUSH


def best_provenance(provenance: dict, backend_name: str, run_id: int, flush: str) -> dict:
    """What a best config stored by this run records of its measurement (`flush`: the run's L2
    flush, l2_flush)."""
    best = {
        "backend": backend_name,
        "l2_flush": flush,
        "gpu_name": provenance.get("gpu_name"),
        "dsl_version": provenance["dsl_version"],
        "torch_version": provenance["torch_version"],
        "fa4tune_version": fa4tune.__version__,
        "run": run_id,
    }
    for key in ("cuda_version", "nvidia_driver"):
        if provenance.get(key):
            best[key] = provenance[key]
    return best
