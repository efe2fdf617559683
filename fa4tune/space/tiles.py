"""Tile shape: Q rows per CTA (64 per consumer warpgroup) and K/V rows per pipeline step. The kernel
family's rules (wgmma and TMA shapes, shared memory, registers) judge each combination."""

from __future__ import annotations

from .base import SearchSpace


class TilesSpace(SearchSpace):
    name = "tiles"
    knobs = ("tile_m", "tile_n")
    description = "CTA tile: tile_m query rows x tile_n key/value rows per step"
