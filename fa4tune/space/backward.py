"""Backward: the tiles, the pipeline depth, the way dQ is added (red.global from registers, or
TMA reductions per Q block from shared memory, issued by a consumer warp or by a producer warp per
warpgroup's slice of columns or rows), the dS^T buffers and the dQ GEMM's orientation (dQ^T = K^T
dS^T, which admits 80-row Q blocks), the order dQ is staged in (dq_flat: the fragments' order,
added by bulk reductions and put back by a cast kernel), LSE2 in registers at 80 rows
(lse_early), the loads' barriers (split_loads: K, V, Q and dO each on its own), one CTA per SM
walking the K blocks (persistent) and dV's GEMM issued before dS^T is made (dv_early) of the
backward kernel family (fa4_bwd_sm90), its default space. The dQ accumulation's determinism is not
searched: the caller chooses it (torch.use_deterministic_algorithms), and the tuned tiles serve
both modes (config.deterministic_config: register adds in order, the tuned tiles where the turn
fits)."""

from __future__ import annotations

from .base import Choice, SearchSpace


class BackwardSpace(SearchSpace):
    name = "backward"
    knobs = (
        "tile_m",
        "tile_n",
        "num_stages",
        "dq_tma",
        "ds_stages",
        "dq_warp",
        "dq_rows",
        "dq_swap",
        "q_halves",
        "exp2_turns",
        "dq_single",
        "dq_flat",
        "lse_early",
        "split_loads",
        "persistent",
        "dv_early",
    )
    description = (
        "backward: Q rows per step, K/V rows per CTA, Q/dO pipeline depth, dQ adds, dS^T "
        "buffers, who issues the dQ reductions, dQ's GEMM split by rows or columns or swapped, "
        "S^T and dP^T in halves of the Q block, the warpgroups' turns at the exp2, dQ in one "
        "warpgroup, dQ staged in fragment order, LSE2 in registers at 80 rows, K/V and Q/dO on "
        "barriers of their own, one CTA per SM walking the K blocks, dV's GEMM issued before dS^T"
    )

    def params(self):
        return {
            "tile_m": Choice([64, 80, 128]),
            "tile_n": Choice([64, 128]),
            "num_stages": Choice([1, 2]),
            "dq_tma": Choice([False, True]),
            "ds_stages": Choice([1, 2]),
            "dq_warp": Choice([False, True]),
            "dq_rows": Choice([False, True]),
            "dq_swap": Choice([False, True]),
            "q_halves": Choice([False, True]),
            "exp2_turns": Choice([False, True]),
            "dq_single": Choice([False, True]),
            "dq_flat": Choice([False, True]),
            "lse_early": Choice([False, True]),
            "split_loads": Choice([False, True]),
            "persistent": Choice([False, True]),
            "dv_early": Choice([False, True]),
        }
