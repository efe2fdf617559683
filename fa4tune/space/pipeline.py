"""K/V pipeline: how many TMA stages are in flight, and whether a warpgroup overlaps its softmax with
its next QK^T GEMM (two score tiles live at once: more registers)."""

from __future__ import annotations

from .base import SearchSpace


class PipelineSpace(SearchSpace):
    name = "pipeline"
    knobs = ("num_stages", "intra_wg_overlap")
    description = "K/V pipeline depth and intra-warpgroup GEMM/softmax overlap"

    def check(self, problem, config, target) -> list[str]:
        from ..kernels import resources

        return resources.smem_reasons(config, problem, target) + resources.register_reasons(
            config, problem, target
        )
