"""The backward kernel on the GPU: dq, dk and dv against the fp32 gradient reference with poisoned
outputs (the family's own measurement case and check, as the search runs them), the deterministic
mode bitwise repeatable, and autograd through fa4tune.attention."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

from fa4tune.kernels.fa4_bwd_sm90 import FAMILY  # noqa: E402
from fa4tune.kernels.fa4_bwd_sm90.config import BwdConfig  # noqa: E402
from fa4tune.problem import Problem  # noqa: E402
from fa4tune.target import get_target  # noqa: E402

H200 = get_target("H200")

CASES = [
    # (problem fields, config or None for the default)
    (dict(head_dim=128, seqlen_q=1024, batch=2, nheads_q=8), None),
    (dict(head_dim=128, seqlen_q=1024, batch=2, nheads_q=8, causal=True), None),
    (dict(head_dim=64, seqlen_q=2048, batch=2, nheads_q=8, causal=True), None),
    (dict(head_dim=96, seqlen_q=1000, batch=2, nheads_q=6, causal=True), None),  # off the tiles
    (dict(head_dim=128, seqlen_q=777, seqlen_k=1029, batch=1, nheads_q=8, nheads_kv=2,
          causal=True), None),  # GQA, more keys than queries
    (dict(head_dim=128, seqlen_q=1029, seqlen_k=500, batch=1, nheads_q=4, causal=True),
     None),  # fewer keys than queries: the top rows see none
    (dict(head_dim=64, seqlen_q=512, seqlen_k=3000, batch=2, nheads_q=8, nheads_kv=1), None),  # MQA
    (dict(head_dim=128, seqlen_q=1024, batch=2, nheads_q=8, causal=True),
     BwdConfig(deterministic=True)),
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=4), BwdConfig(tile_n=64, num_stages=1)),
    # dQ through shared memory and TMA reductions: rows past seqlen_q clipped, GQA, one warpgroup.
    (dict(head_dim=128, seqlen_q=1024, batch=2, nheads_q=8, causal=True), BwdConfig(dq_tma=True)),
    (dict(head_dim=96, seqlen_q=1000, batch=2, nheads_q=6, causal=True), BwdConfig(dq_tma=True)),
    (dict(head_dim=128, seqlen_q=777, seqlen_k=1029, batch=1, nheads_q=8, nheads_kv=2,
          causal=True), BwdConfig(dq_tma=True)),
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=4),
     BwdConfig(tile_n=64, num_stages=1, dq_tma=True)),
    # 128-row Q blocks (head dim 64, no mask): rows past seqlen_q, GQA, both dQ adds.
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=8, nheads_kv=2), BwdConfig(tile_m=128)),
    (dict(head_dim=64, seqlen_q=700, seqlen_k=1300, batch=2, nheads_q=4),
     BwdConfig(tile_m=128, num_stages=1, dq_tma=True)),
    # Two dS^T buffers, no barrier before writing one: GQA, deterministic, 128-row blocks.
    (dict(head_dim=128, seqlen_q=777, seqlen_k=1029, batch=1, nheads_q=8, nheads_kv=2,
          causal=True), BwdConfig(dq_tma=True, ds_stages=2)),
    (dict(head_dim=128, seqlen_q=1024, batch=2, nheads_q=8, causal=True),
     BwdConfig(deterministic=True, ds_stages=2)),
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=8, nheads_kv=2),
     BwdConfig(tile_m=128, ds_stages=2)),
    # 128-row Q blocks with the causal mask as one bound per column: the diagonal, more and fewer
    # keys than queries, rows past a tile.
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=8, nheads_kv=2, causal=True),
     BwdConfig(tile_m=128)),
    (dict(head_dim=64, seqlen_q=777, seqlen_k=1029, batch=1, nheads_q=4, causal=True),
     BwdConfig(tile_m=128, num_stages=1, dq_tma=True)),
    (dict(head_dim=64, seqlen_q=1029, seqlen_k=500, batch=1, nheads_q=4, causal=True),
     BwdConfig(tile_m=128, dq_tma=True, ds_stages=2)),
    # The causal deterministic order (the last K block that sees a Q block adds first, launched
    # first): more and fewer keys than queries, GQA, one warpgroup.
    (dict(head_dim=128, seqlen_q=777, seqlen_k=1029, batch=1, nheads_q=8, nheads_kv=2,
          causal=True), BwdConfig(deterministic=True, ds_stages=2)),
    (dict(head_dim=128, seqlen_q=1029, seqlen_k=500, batch=1, nheads_q=4, causal=True),
     BwdConfig(deterministic=True)),
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=4, causal=True),
     BwdConfig(tile_n=64, num_stages=1, deterministic=True)),
    # dQ reductions per warpgroup slice from a producer warp: rows past seqlen_q clipped, GQA,
    # 128-row blocks, head dim 96 (48-column slices), one warpgroup.
    (dict(head_dim=128, seqlen_q=777, seqlen_k=1029, batch=1, nheads_q=8, nheads_kv=2,
          causal=True), BwdConfig(dq_tma=True, dq_warp=True, ds_stages=2)),
    (dict(head_dim=64, seqlen_q=1029, seqlen_k=500, batch=1, nheads_q=4, causal=True),
     BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, ds_stages=2)),
    (dict(head_dim=96, seqlen_q=1000, batch=2, nheads_q=6, causal=True),
     BwdConfig(dq_tma=True, dq_warp=True)),
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=4),
     BwdConfig(tile_n=64, num_stages=1, dq_tma=True, dq_warp=True)),
    # ... deterministic: the dQ warp issues a block's reductions at the CTA's turn.
    (dict(head_dim=128, seqlen_q=777, seqlen_k=1029, batch=1, nheads_q=8, nheads_kv=2,
          causal=True), BwdConfig(deterministic=True, dq_tma=True, dq_warp=True, ds_stages=2)),
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=8, nheads_kv=2),
     BwdConfig(tile_m=128, deterministic=True, dq_tma=True, dq_warp=True, ds_stages=2)),
    # Head dims 192 and 256 in chunks of 96 and 128 columns (a CTA per chunk): rows and keys past
    # a tile, GQA, causal both ways, the dQ warp's slices, one warpgroup, deterministic.
    (dict(head_dim=192, seqlen_q=777, seqlen_k=1029, batch=1, nheads_q=8, nheads_kv=2,
          causal=True), BwdConfig()),
    (dict(head_dim=256, seqlen_q=1029, seqlen_k=500, batch=2, nheads_q=4),
     BwdConfig(num_stages=1)),
    (dict(head_dim=192, seqlen_q=1000, batch=2, nheads_q=6),
     BwdConfig(num_stages=1, dq_tma=True, dq_warp=True)),
    (dict(head_dim=192, seqlen_q=1029, seqlen_k=700, batch=1, nheads_q=4, causal=True),
     BwdConfig(tile_n=64, dq_tma=True, dq_warp=True, ds_stages=2)),
    (dict(head_dim=256, seqlen_q=1500, batch=1, nheads_q=4, nheads_kv=2, causal=True),
     BwdConfig(num_stages=1, deterministic=True)),
    # ... dQ split by rows (each warpgroup 64 Q rows, its own TMA reduction): rows past seqlen_q
    # in the second warpgroup's half and in both, GQA, one stage, deterministic.
    (dict(head_dim=64, seqlen_q=1029, seqlen_k=500, batch=1, nheads_q=4, causal=True),
     BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, ds_stages=2, dq_rows=True)),
    (dict(head_dim=64, seqlen_q=777, seqlen_k=1029, batch=2, nheads_q=8, nheads_kv=2),
     BwdConfig(tile_m=128, num_stages=1, dq_tma=True, dq_warp=True, dq_rows=True)),
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=8, nheads_kv=2, causal=True),
     BwdConfig(tile_m=128, deterministic=True, dq_tma=True, dq_warp=True, ds_stages=2,
               dq_rows=True)),
    # ... S^T and dP^T in two parts of 64 queries (q_halves): rows past seqlen_q in the second
    # part and in both, the causal diagonal across the parts, GQA, more and fewer keys than
    # queries, each dQ path (columns, rows, the consumer warp's TMA, the register adds), one dS^T
    # buffer, one stage, deterministic.
    (dict(head_dim=64, seqlen_q=1029, seqlen_k=500, batch=1, nheads_q=4, causal=True),
     BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, ds_stages=2, dq_rows=True, q_halves=True)),
    (dict(head_dim=64, seqlen_q=777, seqlen_k=1029, batch=2, nheads_q=8, nheads_kv=2,
          causal=True), BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, q_halves=True)),
    (dict(head_dim=64, seqlen_q=1000, seqlen_k=3000, batch=1, nheads_q=8, nheads_kv=2),
     BwdConfig(tile_m=128, num_stages=1, dq_tma=True, q_halves=True)),
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=4, causal=True),
     BwdConfig(tile_m=128, ds_stages=2, q_halves=True)),
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=8, nheads_kv=2, causal=True),
     BwdConfig(tile_m=128, deterministic=True, dq_tma=True, dq_warp=True, ds_stages=2,
               dq_rows=True, q_halves=True)),
    # dQ^T = K^T dS^T (dq_swap) with 80-row Q blocks (head dim 128): rows past seqlen_q (LSE2
    # +inf, TMA clipping) where 80 divides no seqlen here, the causal mask's diagonal across 80-row
    # blocks, GQA, more and fewer keys than queries; each dQ path: the dQ warp, the consumer
    # warp's TMA reduction, the register adds (one value at a time), deterministic by the dQ
    # warp's turn; one stage; the swap at 64 rows.
    (dict(head_dim=128, seqlen_q=1000, seqlen_k=3000, batch=1, nheads_q=8, nheads_kv=2),
     BwdConfig(tile_m=80, dq_swap=True, dq_tma=True, dq_warp=True, ds_stages=2)),
    (dict(head_dim=128, seqlen_q=777, seqlen_k=1029, batch=1, nheads_q=8, nheads_kv=2,
          causal=True), BwdConfig(tile_m=80, dq_swap=True, dq_tma=True, dq_warp=True,
                                  ds_stages=2)),
    (dict(head_dim=128, seqlen_q=1029, seqlen_k=500, batch=1, nheads_q=4, causal=True),
     BwdConfig(tile_m=80, dq_swap=True, dq_tma=True, dq_warp=True, ds_stages=2)),
    (dict(head_dim=128, seqlen_q=777, batch=2, nheads_q=8, causal=True),
     BwdConfig(tile_m=80, dq_swap=True, dq_tma=True)),
    (dict(head_dim=128, seqlen_q=1000, seqlen_k=3000, batch=1, nheads_q=8, nheads_kv=2,
          causal=True), BwdConfig(tile_m=80, dq_swap=True)),
    (dict(head_dim=128, seqlen_q=777, batch=2, nheads_q=8),
     BwdConfig(tile_m=80, num_stages=1, dq_swap=True, ds_stages=2)),
    (dict(head_dim=128, seqlen_q=777, seqlen_k=1029, batch=1, nheads_q=8, nheads_kv=2,
          causal=True), BwdConfig(tile_m=80, dq_swap=True, deterministic=True, dq_tma=True,
                                  dq_warp=True)),
    (dict(head_dim=128, seqlen_q=1000, batch=2, nheads_q=8, causal=True),
     BwdConfig(dq_swap=True, dq_tma=True, dq_warp=True, ds_stages=2)),
    (dict(head_dim=128, seqlen_q=4096, batch=1, nheads_q=4),
     BwdConfig(tile_m=80, dq_swap=True, dq_tma=True, dq_warp=True, ds_stages=2)),
    # Causal CTAs in sections of K/V heads (launch.heads_per_section: 8, 2 and 2 heads in the
    # causal cases above, 4 here over three batches, and for hd192's chunks).
    (dict(head_dim=128, seqlen_q=1500, seqlen_k=1200, batch=3, nheads_q=16, nheads_kv=4,
          causal=True), None),
    (dict(head_dim=192, seqlen_q=700, batch=3, nheads_q=4, nheads_kv=4, causal=True),
     BwdConfig(num_stages=1, dq_tma=True, dq_warp=True)),
]  # fmt: skip


def run_case(problem, config, seed=3):
    case = FAMILY.measurement_case(problem, "cuda")
    FAMILY.randomize(case, seed)
    refs = FAMILY.reference(case)
    FAMILY.poison(case)
    FAMILY.launcher(case, config or FAMILY.default_config(problem, H200), H200)()
    torch.cuda.synchronize()
    return case, FAMILY.compare(case, refs)


def check_gradients(fields, config):
    """dq, dk and dv of the case within the family's tolerance of the fp32 reference."""
    problem = Problem(**fields)
    _, result = run_case(problem, config)
    assert result.verdict(FAMILY.tolerance(problem)) is None, result


@pytest.mark.parametrize("fields,config", CASES, ids=lambda v: str(v))
def test_gradients_match_the_reference(fields, config):
    check_gradients(fields, config)


# The warpgroups' turns at the exp2 (exp2_turns): the halves (two turns a step each) with rows past
# seqlen_q, the diagonal across the parts, GQA, one step per CTA, more keys than queries; the
# whole block at head dims 128 (80-row swapped, 64-row) and 96; the register adds; deterministic.
TURNS_CASES = [
    (dict(head_dim=64, seqlen_q=1029, seqlen_k=500, batch=1, nheads_q=4, causal=True),
     BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, ds_stages=2, dq_rows=True, q_halves=True,
               exp2_turns=True)),
    (dict(head_dim=64, seqlen_q=777, seqlen_k=1029, batch=2, nheads_q=8, nheads_kv=2),
     BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, q_halves=True, exp2_turns=True)),
    (dict(head_dim=64, seqlen_q=100, seqlen_k=300, batch=2, nheads_q=2, causal=True),
     BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, ds_stages=2, dq_rows=True, q_halves=True,
               exp2_turns=True)),
    (dict(head_dim=128, seqlen_q=777, seqlen_k=1029, batch=1, nheads_q=8, nheads_kv=2,
          causal=True), BwdConfig(tile_m=80, dq_swap=True, dq_tma=True, dq_warp=True,
                                  ds_stages=2, exp2_turns=True)),
    (dict(head_dim=128, seqlen_q=1000, seqlen_k=3000, batch=1, nheads_q=8, nheads_kv=2),
     BwdConfig(dq_swap=True, dq_tma=True, dq_warp=True, ds_stages=2, exp2_turns=True)),
    (dict(head_dim=96, seqlen_q=1500, batch=2, nheads_q=4, causal=True),
     BwdConfig(dq_tma=True, dq_warp=True, ds_stages=2, exp2_turns=True)),
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=4, causal=True),
     BwdConfig(tile_m=128, ds_stages=2, q_halves=True, exp2_turns=True)),
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=8, nheads_kv=2, causal=True),
     BwdConfig(tile_m=128, deterministic=True, dq_tma=True, dq_warp=True, ds_stages=2,
               dq_rows=True, q_halves=True, exp2_turns=True)),
]  # fmt: skip


@pytest.mark.parametrize("fields,config", TURNS_CASES, ids=lambda v: str(v))
def test_exp2_turns_gradients_match_the_reference(fields, config):
    check_gradients(fields, config)


# dq_single (the first warpgroup computes dQ, the second runs up to a step ahead): head dim 96
# causal and with GQA, rows past seqlen_q, few steps per CTA (the trailing frees of one and two
# steps), one Q stage at head dim 64, the halves and the whole 128-row block, deterministic, head
# dim 192's chunks.
SINGLE_CASES = [
    (dict(head_dim=96, seqlen_q=1500, batch=2, nheads_q=4, causal=True),
     BwdConfig(dq_tma=True, dq_warp=True, ds_stages=2, dq_single=True)),
    (dict(head_dim=96, seqlen_q=777, seqlen_k=1029, batch=2, nheads_q=8, nheads_kv=2),
     BwdConfig(dq_tma=True, dq_warp=True, ds_stages=2, dq_single=True)),
    (dict(head_dim=96, seqlen_q=100, seqlen_k=300, batch=2, nheads_q=2, causal=True),
     BwdConfig(dq_tma=True, dq_warp=True, ds_stages=2, dq_single=True)),
    (dict(head_dim=96, seqlen_q=64, seqlen_k=200, batch=3, nheads_q=2),
     BwdConfig(dq_tma=True, dq_warp=True, ds_stages=2, dq_single=True)),
    (dict(head_dim=64, seqlen_q=1029, seqlen_k=500, batch=1, nheads_q=8, nheads_kv=2,
          causal=True), BwdConfig(num_stages=1, dq_tma=True, dq_warp=True, ds_stages=2,
                                  dq_single=True)),
    (dict(head_dim=64, seqlen_q=1029, seqlen_k=500, batch=1, nheads_q=4, causal=True),
     BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, ds_stages=2, q_halves=True,
               dq_single=True)),
    (dict(head_dim=64, seqlen_q=777, seqlen_k=1029, batch=2, nheads_q=8, nheads_kv=2),
     BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, ds_stages=2, dq_single=True)),
    (dict(head_dim=96, seqlen_q=1500, batch=2, nheads_q=8, nheads_kv=2, causal=True),
     BwdConfig(deterministic=True, dq_tma=True, dq_warp=True, ds_stages=2, dq_single=True)),
    (dict(head_dim=192, seqlen_q=700, batch=2, nheads_q=4, causal=True),
     BwdConfig(num_stages=1, dq_tma=True, dq_warp=True, ds_stages=2, dq_single=True)),
]  # fmt: skip


@pytest.mark.parametrize("fields,config", SINGLE_CASES, ids=lambda v: str(v))
def test_dq_single_gradients_match_the_reference(fields, config):
    check_gradients(fields, config)


# dq_flat (dQ staged in fragment order, bulk reductions into a flat accumulator, the cast kernel):
# the default ladder's rungs at head dims 64 (the rows split with the halves, the column split of
# 128 rows), 96 (dQ in one warpgroup, and split by columns) and 128 (64 rows), rows past seqlen_q
# and fewer than a block of them, GQA and MQA, head dim 192's chunks, deterministic.
FLAT_CASES = [
    (dict(head_dim=64, seqlen_q=1029, seqlen_k=500, batch=1, nheads_q=4, causal=True),
     BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, ds_stages=2, dq_rows=True, q_halves=True,
               dq_flat=True)),
    (dict(head_dim=64, seqlen_q=777, seqlen_k=1029, batch=2, nheads_q=8, nheads_kv=2),
     BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, ds_stages=2, dq_flat=True)),
    (dict(head_dim=64, seqlen_q=40, seqlen_k=300, batch=3, nheads_q=2, causal=True),
     BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, ds_stages=2, dq_rows=True, q_halves=True,
               dq_flat=True)),
    (dict(head_dim=96, seqlen_q=1500, batch=2, nheads_q=4, causal=True),
     BwdConfig(dq_tma=True, dq_warp=True, ds_stages=2, dq_single=True, dq_flat=True)),
    (dict(head_dim=96, seqlen_q=777, seqlen_k=1029, batch=2, nheads_q=8, nheads_kv=2),
     BwdConfig(dq_tma=True, dq_warp=True, ds_stages=2, dq_flat=True)),
    (dict(head_dim=128, seqlen_q=1000, seqlen_k=3000, batch=1, nheads_q=8, nheads_kv=1,
          causal=True), BwdConfig(dq_tma=True, dq_warp=True, ds_stages=2, dq_flat=True)),
    (dict(head_dim=192, seqlen_q=700, batch=2, nheads_q=4, causal=True),
     BwdConfig(num_stages=1, dq_tma=True, dq_warp=True, ds_stages=2, dq_single=True,
               dq_flat=True)),
    (dict(head_dim=64, seqlen_q=1500, batch=2, nheads_q=8, nheads_kv=2, causal=True),
     BwdConfig(tile_m=128, deterministic=True, dq_tma=True, dq_warp=True, ds_stages=2,
               dq_rows=True, q_halves=True, dq_flat=True)),
    # dQ's GEMM swapped (dQ^T's slabs): 80 and 64 rows, rows past seqlen_q, GQA and MQA,
    # deterministic
    (dict(head_dim=128, seqlen_q=1000, seqlen_k=1500, batch=2, nheads_q=8, nheads_kv=2,
          causal=True),
     BwdConfig(tile_m=80, dq_tma=True, dq_warp=True, ds_stages=2, dq_swap=True, dq_flat=True)),
    (dict(head_dim=128, seqlen_q=777, batch=1, nheads_q=4),
     BwdConfig(dq_tma=True, dq_warp=True, ds_stages=2, dq_swap=True, dq_flat=True)),
    (dict(head_dim=128, seqlen_q=1029, batch=1, nheads_q=4, nheads_kv=1, causal=True),
     BwdConfig(tile_m=80, deterministic=True, dq_tma=True, dq_warp=True, dq_swap=True,
               dq_flat=True)),
]  # fmt: skip


@pytest.mark.parametrize("fields,config", FLAT_CASES, ids=lambda v: str(v))
def test_dq_flat_gradients_match_the_reference(fields, config):
    check_gradients(fields, config)


# lse_early: 80 rows, dQ^T staged flat, LSE2 in registers from the step's top (non-causal: the
# one build of it without spills). GQA, rows past seqlen_q and past seqlen_k.
LSE_EARLY_CASES = [
    (dict(head_dim=128, seqlen_q=1000, seqlen_k=1500, batch=2, nheads_q=8, nheads_kv=2),
     BwdConfig(tile_m=80, dq_tma=True, dq_warp=True, ds_stages=2, dq_swap=True, dq_flat=True,
               lse_early=True)),
    (dict(head_dim=128, seqlen_q=777, seqlen_k=333, batch=1, nheads_q=4),
     BwdConfig(tile_m=80, dq_tma=True, dq_warp=True, ds_stages=2, dq_swap=True, dq_flat=True,
               lse_early=True)),
]  # fmt: skip


@pytest.mark.parametrize("fields,config", LSE_EARLY_CASES, ids=lambda v: str(v))
def test_lse_early_gradients_match_the_reference(fields, config):
    check_gradients(fields, config)


# split_loads: K, V, Q and dO on barriers of their own (V after the first Q). The hd64 halves
# causal with GQA and seqlen_k above seqlen_q, 80 rows non-causal with rows off the tiles, the
# deterministic dQ warp, one consumer warpgroup with one stage, head dim 96 with dq_single.
SPLIT_LOADS_CASES = [
    (dict(head_dim=64, seqlen_q=1000, seqlen_k=1500, batch=2, nheads_q=8, nheads_kv=2,
          causal=True),
     BwdConfig(tile_m=128, dq_tma=True, ds_stages=2, dq_warp=True, dq_rows=True, q_halves=True,
               dq_flat=True, split_loads=True)),
    (dict(head_dim=128, seqlen_q=777, seqlen_k=333, batch=1, nheads_q=4),
     BwdConfig(tile_m=80, dq_tma=True, dq_warp=True, ds_stages=2, dq_swap=True, dq_flat=True,
               lse_early=True, split_loads=True)),
    (dict(head_dim=128, seqlen_q=1029, batch=1, nheads_q=4, nheads_kv=1, causal=True),
     BwdConfig(deterministic=True, dq_tma=True, ds_stages=2, dq_warp=True, dq_swap=True,
               split_loads=True)),
    (dict(head_dim=64, seqlen_q=700, seqlen_k=900, batch=2, nheads_q=2, causal=True),
     BwdConfig(tile_n=64, num_stages=1, dq_tma=True, split_loads=True)),
    (dict(head_dim=96, seqlen_q=1000, batch=1, nheads_q=6, causal=True),
     BwdConfig(dq_tma=True, ds_stages=2, dq_warp=True, dq_single=True, dq_flat=True,
               split_loads=True)),
]  # fmt: skip


@pytest.mark.parametrize("fields,config", SPLIT_LOADS_CASES, ids=lambda v: str(v))
def test_split_loads_gradients_match_the_reference(fields, config):
    check_gradients(fields, config)


# dv_early (with dq_flat): P^T's dV GEMM issued before dS^T is made. The hd64 halves causal with
# GQA and seqlen_k above seqlen_q, and persistent non-causal; 64 rows dq_swap causal with GQA, and
# deterministic; 64 rows swapped non-causal off the tiles; head dim 96 with dq_single; head dim 64
# with 64 rows, persistent with GQA, one stage with the exp2 turns.
DV_EARLY_CASES = [
    (dict(head_dim=64, seqlen_q=1000, seqlen_k=1500, batch=2, nheads_q=8, nheads_kv=2,
          causal=True),
     BwdConfig(tile_m=128, dq_tma=True, ds_stages=2, dq_warp=True, dq_rows=True, q_halves=True,
               dq_flat=True, dv_early=True)),
    (dict(head_dim=64, seqlen_q=1000, seqlen_k=1300, batch=2, nheads_q=4),
     BwdConfig(tile_m=128, dq_tma=True, ds_stages=2, dq_warp=True, dq_rows=True, q_halves=True,
               dq_flat=True, persistent=True, dv_early=True)),
    (dict(head_dim=128, seqlen_q=1029, seqlen_k=1300, batch=2, nheads_q=4, nheads_kv=1,
          causal=True),
     BwdConfig(dq_tma=True, ds_stages=2, dq_warp=True, dq_swap=True, dq_flat=True,
               dv_early=True)),
    (dict(head_dim=64, seqlen_q=1000, seqlen_k=1500, batch=4, nheads_q=8, nheads_kv=4,
          causal=True),
     BwdConfig(dq_tma=True, ds_stages=2, dq_warp=True, dq_flat=True, persistent=True,
               dv_early=True)),
    (dict(head_dim=128, seqlen_q=1029, batch=1, nheads_q=4, causal=True),
     BwdConfig(deterministic=True, dq_tma=True, ds_stages=2, dq_warp=True, dq_swap=True,
               dq_flat=True, dv_early=True)),
    (dict(head_dim=128, seqlen_q=777, seqlen_k=333, batch=1, nheads_q=4),
     BwdConfig(dq_tma=True, ds_stages=2, dq_warp=True, dq_swap=True, dq_flat=True,
               dv_early=True)),
    (dict(head_dim=96, seqlen_q=1000, batch=1, nheads_q=6, causal=True),
     BwdConfig(dq_tma=True, ds_stages=2, dq_warp=True, dq_single=True, dq_flat=True,
               dv_early=True)),
    (dict(head_dim=64, seqlen_q=1000, seqlen_k=1300, batch=2, nheads_q=4, causal=True),
     BwdConfig(dq_tma=True, ds_stages=2, dq_warp=True, dq_flat=True, dv_early=True)),
    (dict(head_dim=64, seqlen_q=700, seqlen_k=900, batch=2, nheads_q=2, causal=True),
     BwdConfig(num_stages=1, dq_tma=True, dq_warp=True, dq_flat=True, exp2_turns=True,
               dv_early=True)),
]  # fmt: skip


@pytest.mark.parametrize("fields,config", DV_EARLY_CASES, ids=lambda v: str(v))
def test_dv_early_gradients_match_the_reference(fields, config):
    check_gradients(fields, config)


# persistent: one CTA per SM walking the K blocks, most CTAs two walks or more (walks: K blocks x
# K/V heads x batch, over 132 SMs); causal from the walks' counter. The hd64 halves causal with GQA
# and seqlen_k above seqlen_q, and not; 80 rows with rows off the tiles; 64 rows dq_swap causal;
# head dim 96 with dq_single causal; one consumer warpgroup with one stage; a launch of fewer
# walks than SMs.
PERSISTENT_CASES = [
    (dict(head_dim=64, seqlen_q=1000, seqlen_k=1500, batch=4, nheads_q=8, nheads_kv=4,
          causal=True),
     BwdConfig(tile_m=128, dq_tma=True, ds_stages=2, dq_warp=True, dq_rows=True, q_halves=True,
               dq_flat=True, persistent=True)),
    (dict(head_dim=64, seqlen_q=1000, seqlen_k=1500, batch=4, nheads_q=8, nheads_kv=4),
     BwdConfig(tile_m=128, dq_tma=True, ds_stages=2, dq_warp=True, dq_rows=True, q_halves=True,
               dq_flat=True, persistent=True)),
    (dict(head_dim=128, seqlen_q=777, seqlen_k=900, batch=4, nheads_q=8),
     BwdConfig(tile_m=80, dq_tma=True, dq_warp=True, ds_stages=2, dq_swap=True, dq_flat=True,
               persistent=True)),
    (dict(head_dim=128, seqlen_q=1029, batch=2, nheads_q=16, causal=True),
     BwdConfig(dq_tma=True, ds_stages=2, dq_warp=True, dq_swap=True, persistent=True)),
    (dict(head_dim=96, seqlen_q=1000, batch=6, nheads_q=12, nheads_kv=4, causal=True),
     BwdConfig(dq_tma=True, ds_stages=2, dq_warp=True, dq_single=True, dq_flat=True,
               persistent=True)),
    (dict(head_dim=64, seqlen_q=700, seqlen_k=900, batch=2, nheads_q=24, causal=True),
     BwdConfig(tile_n=64, num_stages=1, dq_tma=True, dq_warp=True, persistent=True)),
    (dict(head_dim=64, seqlen_q=300, batch=1, nheads_q=2, causal=True),
     BwdConfig(tile_m=128, dq_tma=True, ds_stages=2, dq_warp=True, dq_rows=True, dq_flat=True,
               persistent=True)),
]  # fmt: skip


@pytest.mark.parametrize("fields,config", PERSISTENT_CASES, ids=lambda v: str(v))
def test_persistent_gradients_match_the_reference(fields, config):
    check_gradients(fields, config)


def test_persistent_causal_leaves_the_walks_counter_at_zero():
    """The causal walks come from the stream's counter, which the launch's last fetch puts back
    to zero: a second launch on the same stream takes every walk again (both right), and the
    counter reads zero after each."""
    from fa4tune.kernels.common.streams import current_tile_counter

    fields, config = PERSISTENT_CASES[0]
    for _ in range(2):
        check_gradients(fields, config)
        torch.cuda.synchronize()
        assert current_tile_counter(torch.device("cuda", 0)).item() == 0


@pytest.mark.parametrize(
    "head_dim,slab,tile_m,pad",
    [(64, (64, 64, False), 128, 0), (96, (64, 48, False), 64, 0), (96, (64, 96, False), 64, 0),
     (128, (64, 64, False), 64, 0), (64, (64, 32, False), 128, 4), (128, (64, 64, True), 64, 0),
     (128, (80, 64, True), 80, 0), (128, (80, 64, True), 80, 4)],
)  # fmt: skip
def test_the_flat_cast_puts_every_value_back_in_place(head_dim, slab, tile_m, pad):
    """The cast kernel alone: an accumulator laid out in config.flat_dq_offset's order (made here
    by a view and a permute of dQ's padded rows; dq_swap's slabs as dQ^T's accumulator), read back
    into a poisoned dQ, bitwise the 16-bit rounding of every value; rows past seqlen_q (and, with
    pad, the columns past head_dim: strides that are not multiples of 8, which go through a
    contiguous copy) left alone."""
    from fa4tune.kernels.fa4_bwd_sm90.compile import compile_postprocess
    from fa4tune.kernels.fa4_bwd_sm90.launch import run_postprocess

    batch, seqlen_q, heads = 2, 1000, 3
    padded = -(-seqlen_q // tile_m) * tile_m
    gen = torch.Generator(device="cuda").manual_seed(5)
    dq_true = torch.randn(batch, seqlen_q, heads, head_dim, device="cuda", generator=gen)
    full = torch.zeros(batch, padded, heads, head_dim, device="cuda")
    full[:, :seqlen_q] = dq_true
    rows, cols, transposed = slab
    blocks, slices = padded // rows, head_dim // cols
    if transposed:
        # dQ's rows (block, j, c, e) x columns (slice, warp, h, r): the accumulator's 64 rows are
        # dQ's columns -> (batch, head, block, slice, j, warp, r, c, h, e)
        view = full.view(batch, blocks, rows // 8, 4, 2, heads, slices, 4, 2, 8)
        acc = view.permute(0, 5, 1, 6, 2, 7, 9, 3, 8, 4)
    else:
        # rows (block, warp, h, r) x columns (slice, j, c, e) -> (batch, head, block, slice, j,
        # warp, r, c, h, e)
        view = full.view(batch, blocks, 4, 2, 8, heads, slices, cols // 8, 4, 2)
        acc = view.permute(0, 5, 1, 6, 7, 2, 4, 8, 3, 9)
    acc = acc.contiguous().view(batch, padded, heads, head_dim)
    # dQ a view of the first seqlen_q rows of a poisoned buffer: what lies past them must stay
    buffer = torch.full((batch, padded + 8, heads, head_dim + pad), float("nan"), device="cuda",
                        dtype=torch.bfloat16)  # fmt: skip
    dq = buffer[:, :seqlen_q, :, :head_dim]
    run_postprocess(compile_postprocess("bf16", head_dim, slab, H200), acc, dq)
    torch.cuda.synchronize()
    assert torch.equal(dq, dq_true.to(torch.bfloat16))
    assert torch.isnan(buffer[:, seqlen_q:]).all()
    assert torch.isnan(buffer[..., head_dim:]).all()


def bitwise_problem(head_dim):
    return Problem(head_dim=head_dim, seqlen_q=2048, batch=2, nheads_q=8, nheads_kv=2, causal=True)


BITWISE_CASES = [
    (BwdConfig(deterministic=True), 128),
    (BwdConfig(deterministic=True, dq_tma=True, dq_warp=True), 128),
    (BwdConfig(tile_m=128, deterministic=True, dq_tma=True, dq_warp=True, dq_rows=True), 64),
    (BwdConfig(num_stages=1, deterministic=True), 256),  # a semaphore per Q block and chunk
    (BwdConfig(tile_m=80, dq_swap=True, deterministic=True, dq_tma=True, dq_warp=True), 128),
    (
        BwdConfig(
            tile_m=80, dq_swap=True, deterministic=True, dq_tma=True, dq_warp=True, dq_flat=True
        ),
        128,
    ),
    (
        BwdConfig(
            tile_m=128, deterministic=True, dq_tma=True, dq_warp=True, dq_rows=True, q_halves=True
        ),
        64,
    ),
    (
        BwdConfig(
            tile_m=128,
            deterministic=True,
            dq_tma=True,
            dq_warp=True,
            dq_rows=True,
            q_halves=True,
            exp2_turns=True,
        ),
        64,
    ),
    (BwdConfig(deterministic=True, dq_tma=True, dq_warp=True, ds_stages=2, dq_single=True), 96),
    (
        BwdConfig(
            tile_m=128,
            deterministic=True,
            dq_tma=True,
            dq_warp=True,
            dq_rows=True,
            q_halves=True,
            dq_flat=True,
        ),
        64,
    ),
    (
        BwdConfig(
            deterministic=True, dq_tma=True, dq_warp=True, ds_stages=2, dq_single=True, dq_flat=True
        ),
        96,
    ),
]


@pytest.mark.parametrize(
    "config,head_dim",
    BITWISE_CASES,
    ids=lambda c: c.short() if isinstance(c, BwdConfig) else str(c),
)
def test_the_deterministic_mode_is_bitwise_repeatable(config, head_dim):
    problem = bitwise_problem(head_dim)
    case, _ = run_case(problem, config)
    first = [t.clone() for t in (case.dq, case.dk, case.dv)]
    run = FAMILY.launcher(case, config, H200)
    for _ in range(10):
        FAMILY.poison(case)
        run()
        torch.cuda.synchronize()
        for a, b in zip(first, (case.dq, case.dk, case.dv)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("head_dim", [128, 256])
def test_autograd_through_fa4tune_attention_gives_the_reference_gradients(head_dim):
    import fa4tune
    from fa4tune.kernels.common.reference import attention_grads_reference

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, 1000, h, head_dim, generator=g, device="cuda").to(torch.bfloat16)
        for h in (16, 4, 4)
    )
    for t in (q, k, v):
        t.requires_grad_()
    out, lse = fa4tune.attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    out.backward(dout)
    for t, want in zip((q, k, v), attention_grads_reference(q, k, v, dout, causal=True)):
        assert ((t.grad.float() - want).norm() / want.norm()).item() < 2e-2


def test_a_loss_on_the_lse_too_reaches_the_gradients():
    """dLSE enters the preprocessing kernel's D (D = scale x (rowsum(dO * O) - dLSE)): a loss on
    both outputs, rows past a 64-row tile (1000), GQA, head dim 64."""
    import fa4tune
    from fa4tune.kernels.common.reference import attention_grads_reference

    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (
        torch.randn(1, 1000, h, 64, generator=g, device="cuda").to(torch.bfloat16)
        for h in (8, 2, 2)
    )
    for t in (q, k, v):
        t.requires_grad_()
    out, lse = fa4tune.attention(q, k, v, causal=True)
    dout = torch.randn(out.shape, generator=g, device="cuda").to(out.dtype)
    dlse = torch.randn(lse.shape, generator=g, device="cuda")
    torch.autograd.backward((out, lse), (dout, dlse))
    wants = attention_grads_reference(q, k, v, dout, causal=True, dlse=dlse)
    for t, want in zip((q, k, v), wants):
        assert ((t.grad.float() - want).norm() / want.norm()).item() < 2e-2


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("has_dlse", [False, True])
def test_the_preprocessing_kernel_writes_every_row_and_zeroes_the_accumulator(head_dim, has_dlse):
    """preprocess.py alone against its formulas, every output poisoned first: D and LSE2 of each
    row at its stat_position, the padding rows' 0 and +inf, a row that saw no key, and dQ's
    accumulator all zeros. Six heads and 1001 queries padded to 1024: the warp that holds a
    head's last query holds padding rows too (4 rows a warp at head dim 64, 2 at 96 and 128, the
    rows queries fastest: preprocess.row_coords); dO and O are views with a row stride past their
    head dim (as a sliced qkv gives)."""
    import math

    from fa4tune.kernels.fa4_bwd_sm90.compile import compile_preprocess
    from fa4tune.kernels.fa4_bwd_sm90.kernel import stat_position
    from fa4tune.kernels.fa4_bwd_sm90.launch import run_preprocess

    batch, seqlen_q, heads, padded, scale = 2, 1001, 6, 1024, 0.3
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    wide = torch.randn(batch, seqlen_q, heads, head_dim + 8, generator=g, device="cuda")
    dout = wide.to(torch.bfloat16)[..., :head_dim]  # strides multiples of 8, not contiguous
    out = torch.randn(batch, seqlen_q, heads, head_dim, generator=g, device="cuda").bfloat16()
    lse = torch.randn(batch, heads, seqlen_q, generator=g, device="cuda")
    lse[0, 1, 7] = -math.inf  # a row that saw no key
    dlse = torch.randn(batch, heads, seqlen_q, generator=g, device="cuda") if has_dlse else None
    lse2, dsum = (torch.full((batch, heads, padded), math.nan, device="cuda") for _ in "ld")
    dq_acc = torch.full((batch, seqlen_q, heads, head_dim), math.nan, device="cuda")
    function = compile_preprocess("bf16", head_dim, head_dim, has_dlse, H200)
    run_preprocess(function, dout, out, lse, dlse, lse2, dsum, dq_acc, scale)
    torch.cuda.synchronize()

    at = torch.tensor([stat_position(r) for r in range(seqlen_q)], device="cuda")
    d = (dout.float() * out.float()).sum(-1).transpose(1, 2)  # (batch, heads, seqlen_q)
    want_d = torch.zeros(batch, heads, padded, device="cuda")
    want_d[..., at] = scale * (d - dlse if has_dlse else d)
    want_lse2 = torch.full((batch, heads, padded), math.inf, device="cuda")
    want_lse2[..., at] = torch.where(lse == -math.inf, math.inf, lse * math.log2(math.e))
    assert torch.equal(dq_acc, torch.zeros_like(dq_acc))
    assert torch.equal(lse2, want_lse2)
    # the same fp32 products, summed in another order
    assert torch.allclose(dsum, want_d, rtol=1e-5, atol=1e-5), (dsum - want_d).abs().max()
