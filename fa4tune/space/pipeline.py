"""K/V pipeline and scheduling: how many TMA stages are in flight, whether a warpgroup overlaps its
softmax with its next QK^T GEMM (two score tiles live at once: more registers), and whether the
consumer warpgroups ping-pong so that one's softmax overlaps the other's GEMMs; and whether CTAs are
persistent (one per SM, loading the next tile while finishing this one; O then needs its own shared
memory); whether each consumer warpgroup of a persistent CTA stores its O rows on its own; and
whether a persistent CTA double-buffers Q, so that the next tile's Q loads under this tile's
GEMMs."""

from __future__ import annotations

from .base import SearchSpace


class PipelineSpace(SearchSpace):
    name = "pipeline"
    knobs = (
        "num_stages",
        "intra_wg_overlap",
        "wg_pingpong",
        "persistent",
        "wg_epilogue",
        "q_stages",
    )
    description = (
        "K/V pipeline depth, intra-warpgroup overlap, warpgroup ping-pong, persistent CTAs, "
        "per-warpgroup O stores, Q buffers"
    )
