"""K/V pipeline and scheduling: how many TMA stages are in flight, whether a warpgroup overlaps its
softmax with its next QK^T GEMM (two score tiles live at once: more registers), and whether the
consumer warpgroups ping-pong so that one's softmax overlaps the other's GEMMs."""

from __future__ import annotations

from .base import SearchSpace


class PipelineSpace(SearchSpace):
    name = "pipeline"
    knobs = ("num_stages", "intra_wg_overlap", "wg_pingpong")
    description = "K/V pipeline depth, intra-warpgroup overlap, warpgroup ping-pong"

    def check(self, problem, config, target) -> list[str]:
        from ..kernels import resources

        return resources.smem_reasons(config, problem, target) + resources.register_reasons(
            config, problem, target
        )
