"""Tile shape: Q rows per CTA (64 per consumer warpgroup) and K/V rows per pipeline step."""

from __future__ import annotations

from .base import SearchSpace


class TilesSpace(SearchSpace):
    name = "tiles"
    knobs = ("tile_m", "tile_n")
    description = "CTA tile: tile_m query rows x tile_n key/value rows per step"

    def check(self, problem, config, target) -> list[str]:
        from ..kernels import resources

        return (
            resources.tile_reasons(config, problem)
            + resources.smem_reasons(config, problem, target)
            + resources.register_reasons(config, problem, target)
        )
