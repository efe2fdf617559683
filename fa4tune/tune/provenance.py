"""What a search records of where its numbers come from: the versions of the packages that built
and ran the kernel, the GPU fields of a run, and the provenance stored with a best config. The
search process and each worker process record the same fields."""

from __future__ import annotations

from importlib import metadata

import fa4tune

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


def best_provenance(provenance: dict, backend_name: str, run_id: int) -> dict:
    """What a best config stored by this run records of its measurement."""
    best = {
        "backend": backend_name,
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
