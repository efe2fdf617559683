"""Decode: packed GQA (the query heads of one K/V head as the rows of one tile) and split-KV (the
keys of a tile divided among `num_splits` CTAs, merged by a combine kernel, or with
`combine_in_kernel` by the tile's last split CTA). Not among the kernel's default spaces: a prefill
job gains nothing from them, so a decode job names this space. The kernel family's rules say which
combinations the kernel takes (packing needs a group that divides tile_m, splitting a kernel that
is not persistent, the in-kernel combine a split)."""

from __future__ import annotations

from .base import SearchSpace


class DecodeSpace(SearchSpace):
    name = "decode"
    knobs = ("pack_gqa", "num_splits", "combine_in_kernel")
    description = "decode: packed GQA, the split-KV count and where the splits are combined"
