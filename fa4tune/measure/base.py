"""The measurement interface: a backend takes a problem and a feasible config and returns a
Measurement. Backends are chosen by name; `auto` picks the GPU when one is present."""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field
from typing import ClassVar

from ..errors import BackendError

# ok: measured and verified. failed: crashed, hung, did not compile. wrong: above the reference's
# tolerance. pruned: infeasible, never measured. stopped: measured cheaply and stopped by the
# pruner.
STATUSES = ("ok", "failed", "wrong", "pruned", "stopped")


@dataclass(frozen=True)
class Measurement:
    """One measured (or estimated) config. `time_ms` is the median, `spread_ms` the spread of the
    repeats (zero for a deterministic estimate). `max_error` is the largest error against the fp32
    reference (None when nothing was run). Only an `ok` measurement can become a best config."""

    status: str
    time_ms: float | None = None
    spread_ms: float | None = None
    tflops: float | None = None
    max_error: float | None = None
    compile_s: float | None = None
    reason: str | None = None
    is_estimate: bool = False
    details: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, got {self.status!r}")
        if self.status == "ok" and not (self.time_ms and self.time_ms > 0):
            raise ValueError("an ok measurement needs a positive time")
        if self.status != "ok" and not self.reason:
            raise ValueError(f"a {self.status} measurement needs a reason")

    @classmethod
    def ok(cls, problem, time_ms: float, flops: float | None = None, **kwargs) -> Measurement:
        """A timed run; its TFLOP/s count `flops` (the kernel family's work_flops; default the
        problem's forward FLOPs)."""
        flops = problem.flops if flops is None else flops
        return cls(status="ok", time_ms=time_ms, tflops=flops / (time_ms * 1e-3) / 1e12, **kwargs)

    @classmethod
    def pruned(cls, reasons: list[str], is_estimate: bool = False) -> Measurement:
        """A config rejected before anything ran; flagged as its run is, estimated or measured."""
        return cls(status="pruned", reason="; ".join(reasons), is_estimate=is_estimate)

    def to_dict(self) -> dict:
        return asdict(self)


class Backend:
    """Measures configs of one kernel on one target. Subclasses set `name` and `is_estimate` and
    implement `measure`; `provenance` says what the measurements were taken on.

    A measuring backend may also: take a `should_stop(cheap_ms) -> reason | None` callback in
    `measure` (`multi_fidelity`), want the few best of a problem re-timed by `confirm` before one is
    stored as best (`confirms_best`), and compile ahead the `lookahead` candidates it is told of by
    `prefetch`."""

    name: ClassVar[str] = ""
    is_estimate: ClassVar[bool] = False
    multi_fidelity: ClassVar[bool] = False
    confirms_best: ClassVar[bool] = False
    lookahead: int = 0
    confirm_count: int = 0
    min_gain: float = (
        0.0  # a confirmed config replaces the default only when this much faster (0.003:
    )
    # 0.3%) and faster in every confirmation round (store.beats_default)

    def __init__(self, kernel, target) -> None:
        self.kernel = kernel
        self.target = target

    def measure(self, problem, config) -> Measurement:
        raise NotImplementedError

    def prefetch(self, problem, config) -> None:
        """A candidate that `measure` will be asked for soon (a hint; nothing by default)."""

    def discard(self, problem, config) -> None:
        """A prefetched candidate that will not be measured after all (nothing by default)."""

    def note_stored_good(self, problem, config: dict) -> None:
        """A config of `problem` that the results DB holds as measured ok, told when the problem
        starts (nothing by default; the gpu backend checks the GPU with it after crashes)."""

    def confirm(self, problem, configs: list[dict]) -> list[Measurement]:
        """Measure `configs` again, side by side, before the fastest is stored as best."""
        raise NotImplementedError

    def make_pruner(self):
        """The Optuna pruner that judges cheap measurements (None: no early stopping)."""
        return None

    def provenance(self) -> dict:
        """Fields for the run record: gpu_name, sm_count, cuda_driver (None where inapplicable)."""
        return {"gpu_name": None, "sm_count": self.target.sm_count, "cuda_driver": None}

    def close(self) -> None:
        """Release workers or devices; the search calls it when done, also after an interrupt."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# Backends by name, imported on first use (the gpu one pulls in torch and cutlass).
BACKENDS = {
    "model": "fa4tune.measure.model:CostModelBackend",
    "gpu": "fa4tune.measure.gpu:GpuBackend",
}


def cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def resolve_backend_name(name: str, announce=print) -> str:
    """`model`, `gpu`, or `auto` (gpu with a CUDA GPU, else model, and says so)."""
    if name == "auto":
        if cuda_available():
            return "gpu"
        announce("fa4tune: no CUDA GPU here; using the analytic cost model (results are estimates)")
        return "model"
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; known backends: auto, {', '.join(BACKENDS)}")
    return name


def backend_class(name: str) -> type[Backend]:
    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; known backends: auto, {', '.join(BACKENDS)}")
    module_name, _, attr = BACKENDS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise BackendError(
                f"the {name!r} backend is not part of this fa4tune version ({module_name} "
                "is missing); use backend: model"
            ) from exc
        raise BackendError(f"the {name!r} backend cannot be imported: {exc}") from exc
    return getattr(module, attr)


def make_backend(name: str, kernel, target, announce=print, **options) -> Backend:
    return backend_class(resolve_backend_name(name, announce))(kernel, target, **options)
