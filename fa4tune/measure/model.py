"""The `model` backend: a kernel family's analytic cost model (KernelFamily.cost_model) times each
candidate on the CPU. Deterministic; every result is marked as an estimate."""

from __future__ import annotations

from .base import Backend, Measurement


class CostModelBackend(Backend):
    name = "model"
    is_estimate = True

    def __init__(self, kernel, target, assumptions=None) -> None:
        super().__init__(kernel, target)
        self.model = kernel.cost_model(target, assumptions)

    def measure(self, problem, config) -> Measurement:
        seconds, details = self.model.time_s(config, problem)
        return Measurement.ok(
            problem,
            seconds * 1e3,
            flops=self.kernel.work_flops(problem),
            spread_ms=0.0,
            is_estimate=True,
            details=details,
        )

    def provenance(self) -> dict:
        return {
            "gpu_name": f"{self.target.name} (cost model)",
            "sm_count": self.target.sm_count,
            "cuda_driver": None,
            **self.model.provenance(),
        }
