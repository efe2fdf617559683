"""The backward family (fa4_bwd_sm90) on the CPU: its knobs and rules, the launch's preparation
(LSE2, D, the dQ accumulator, dlse) and finish (dQ from the accumulator) around a kernel played by
the CPU block by block as the CUDA kernel walks them (its masks, its Q-block range, GQA summed in
the CTA), against autograd through the fp32 reference; and (marked `compile`) the kernels built for
sm_90a without spills or serialized wgmma."""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import types
from dataclasses import replace

import pytest
import torch

from fa4tune.kernels.common.reference import attention_grads_reference, attention_reference
from fa4tune.kernels.fa4_bwd_sm90 import FAMILY
from fa4tune.kernels.fa4_bwd_sm90 import config as cfg
from fa4tune.kernels.fa4_bwd_sm90.config import BwdConfig, ConfigError, default_config
from fa4tune.problem import Problem
from fa4tune.target import get_target

H200 = get_target("H200")
BF16 = torch.bfloat16


# ---- knobs and rules ----------------------------------------------------------------------------
def test_every_gpu_case_runs_a_config_the_rules_admit():
    """The GPU cases (tests/test_backward_gpu.py) are checked on the CPU first: a case whose
    config the rules refuse (shared memory, a known spill) would fail on the GPU as a ConfigError,
    spending device time on a typo."""
    from test_backward_gpu import (
        BITWISE_CASES,
        CASES,
        FLAT_CASES,
        LSE_EARLY_CASES,
        SINGLE_CASES,
        TURNS_CASES,
        bitwise_problem,
    )

    listed = CASES + TURNS_CASES + SINGLE_CASES + FLAT_CASES + LSE_EARLY_CASES
    cases = [(Problem(**fields), config) for fields, config in listed]
    cases += [(bitwise_problem(head_dim), config) for config, head_dim in BITWISE_CASES]
    for problem, config in cases:
        config = config or FAMILY.default_config(problem, H200)
        assert FAMILY.infeasible_reasons(problem, config, H200) == [], (problem.key(), config)


def test_the_config_schema_refuses_unknown_and_illegal_knobs():
    assert BwdConfig.from_dict({"tile_m": 64.0}).tile_m == 64
    with pytest.raises(ConfigError, match="unknown knob"):
        BwdConfig.from_dict({"tile_k": 64})
    with pytest.raises(ConfigError, match="tile_n=96"):
        BwdConfig(tile_n=96)
    assert BwdConfig(deterministic=True).short() == "64x128s2-det"
    assert BwdConfig(dq_tma=True).short() == "64x128s2-tma"
    assert BwdConfig(dq_tma=True, dq_warp=True, ds_stages=2).short() == "64x128s2-tma-w-ds2"


def test_dq_through_tma_takes_shared_memory_and_leaves_determinism_to_registers():
    p = Problem(head_dim=128, causal=True)
    tma = BwdConfig(dq_tma=True)
    assert not FAMILY.infeasible_reasons(p, tma, H200)
    parts = cfg.smem_parts(tma, p)
    assert parts["dq"] == 64 * 128 * 4 and cfg.smem_parts(BwdConfig(), p)["dq"] == 0
    reasons = FAMILY.infeasible_reasons(p, BwdConfig(dq_tma=True, deterministic=True), H200)
    assert any("not at the CTA's turn" in r for r in reasons)
    assert tma.as_deterministic() == BwdConfig(deterministic=True)
    # The dQ warp issues TMA reductions (it needs dq_tma), at the CTA's turn when deterministic:
    # the turn then takes no consumer registers, so 128-row blocks keep it at head dim 64.
    assert any(
        "dq_warp without dq_tma" in r
        for r in FAMILY.infeasible_reasons(p, BwdConfig(dq_warp=True), H200)
    )
    warp = BwdConfig(dq_tma=True, dq_warp=True)
    assert not FAMILY.infeasible_reasons(p, warp, H200)
    assert warp.as_deterministic() == replace(warp, deterministic=True)
    assert not FAMILY.infeasible_reasons(p, warp.as_deterministic(), H200)
    wide = BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, ds_stages=2)
    assert cfg.deterministic_config(wide, Problem(head_dim=64), H200) == replace(
        wide, deterministic=True
    )
    # Under torch.use_deterministic_algorithms a tuned dq_tma config runs with register adds.
    assert not FAMILY.infeasible_reasons(p, tma.as_deterministic(), H200)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_every_default_is_feasible(head_dim, causal):
    p = Problem(head_dim=head_dim, causal=causal, seqlen_q=4096, batch=4, nheads_q=16)
    config = default_config(p, H200)
    assert not FAMILY.infeasible_reasons(p, config, H200)
    # 128 Q rows a step where they fit (head dim 64), with dQ's GEMM split by rows and S^T and
    # dP^T in halves there, else 64, with dQ's GEMM swapped where it fits (head dim 128), in the
    # first warpgroup alone where that fits (head dim 96); dQ by TMA from the dQ warp, two dS^T
    # buffers; dQ staged flat where it is not swapped; at head dim 128 non-causal 80 rows,
    # swapped, flat, LSE2 in registers (lse_early)
    wide, m80 = head_dim == 64, head_dim == 128 and not causal
    assert config == BwdConfig(
        tile_m=128 if wide else 80 if m80 else 64, dq_tma=True, ds_stages=2, dq_warp=True,
        dq_rows=wide, dq_swap=head_dim == 128, q_halves=wide, dq_single=head_dim == 96,
        dq_flat=head_dim != 128 or m80, lse_early=m80,
    )  # fmt: skip
    # the deterministic mode keeps the tiles and the dQ warp: it issues the reductions in turn
    # (lse_early spills beside the turn: the 64-row swapped rung)
    det = cfg.deterministic_config(config, p, H200)
    if m80:
        assert det == BwdConfig(deterministic=True, dq_tma=True, ds_stages=2, dq_warp=True,
                                dq_swap=True)  # fmt: skip
    else:
        assert det == replace(config, deterministic=True)
    assert not FAMILY.infeasible_reasons(p, det, H200)


def test_configs_that_would_spill_or_serialize_are_refused_and_unequal_head_dims_named():
    p = Problem(head_dim=128)
    reasons = FAMILY.infeasible_reasons(p, BwdConfig(tile_n=64), H200)
    assert any("would spill or serialize" in r for r in reasons)  # one warpgroup: dQ is 64 regs
    assert FAMILY.infeasible_reasons(p, BwdConfig(tile_m=128), H200)
    reasons = FAMILY.infeasible_reasons(Problem(head_dim=128, head_dim_v=64), BwdConfig(), H200)
    assert any("equal head dims" in r for r in reasons)


def edge_configs(dq_warp: bool = False):
    """(config, causal) of every 128-row config the rules admit at head dim 64 (with dq_warp: the
    dQ warp's, deterministic or not, dQ split by columns or rows)."""
    knobs = (
        [dict(dq_tma=True, dq_warp=True, deterministic=det, dq_rows=rows)
         for det in (False, True) for rows in (False, True)]
        if dq_warp else [dict(dq_tma=tma) for tma in (False, True)]
    )  # fmt: skip
    return [
        (config, causal)
        for config in (
            BwdConfig(tile_m=128, tile_n=n, num_stages=st, ds_stages=ds, **k)
            for n in (64, 128) for st in (1, 2) for k in knobs for ds in (1, 2)
        )
        for causal in (False, True)
        if not FAMILY.infeasible_reasons(Problem(head_dim=64, causal=causal), config, H200)
    ]  # fmt: skip


def test_128_row_q_blocks_fit_at_head_dim_64_but_for_the_turn_and_known_spills():
    """The register model at its calibrated edge (compiled for sm_90a: test below)."""
    full, causal = Problem(head_dim=64), Problem(head_dim=64, causal=True)
    for stages in (1, 2):
        for tma in (False, True):
            config = BwdConfig(tile_m=128, num_stages=stages, dq_tma=tma)
            assert not FAMILY.infeasible_reasons(full, config, H200), config.short()
            reasons = FAMILY.infeasible_reasons(causal, config, H200)
            assert bool(reasons) == (stages == 2 and tma), config.short()
    [known] = FAMILY.infeasible_reasons(causal, BwdConfig(tile_m=128, dq_tma=True), H200)
    assert "ptxas spills 12 bytes" in known
    assert len(edge_configs()) == 15
    # The dQ warp's: deterministic too (the turn is the dQ warp's), and no known spill.
    assert len(edge_configs(dq_warp=True)) == 32  # each 128 x 128: dQ by columns or rows
    assert FAMILY.infeasible_reasons(full, BwdConfig(tile_m=128, deterministic=True), H200)
    assert FAMILY.infeasible_reasons(full, BwdConfig(tile_m=128, tile_n=64), H200)
    assert FAMILY.infeasible_reasons(Problem(head_dim=96), BwdConfig(tile_m=128), H200)


def test_the_lse_and_d_go_into_registers_early_where_the_model_leaves_room():
    """(LSE2 before the GEMMs, D before the exp2): tile_m / 4 registers each beyond the model's
    need; the compile tests check that no admitted config spills with them."""
    early = {
        (d, config.short()): cfg.stats_in_registers(config, Problem(head_dim=d))
        for d in (64, 96, 128)
        for config in (BwdConfig(dq_tma=True, ds_stages=2, dq_warp=True), *cfg.DEFAULT_LADDER[:2])
        if not FAMILY.infeasible_reasons(Problem(head_dim=d), config, H200)
    }
    assert early == {
        (64, "64x128s2-tma-w-ds2"): (True, True),
        (64, "128x128s2-tma-w-r-ds2-h2-fl"): (True, True),  # a part's stats
        (64, "128x128s2-tma-w-r-ds2"): (False, False),  # at the model's edge
        (96, "64x128s2-tma-w-ds2"): (True, True),
        (128, "64x128s2-tma-w-ds2"): (True, False),
    }
    # The consumers' deterministic turn takes the room at head dim 128.
    det = BwdConfig(deterministic=True)
    assert cfg.stats_in_registers(det, Problem(head_dim=128)) == (False, False)


def test_two_ds_buffers_take_their_shared_memory_and_keep_the_deterministic_mode():
    p = Problem(head_dim=128, causal=True)
    two = BwdConfig(dq_tma=True, ds_stages=2)
    assert two.short() == "64x128s2-tma-ds2"
    assert cfg.smem_parts(two, p)["ds"] == 2 * cfg.smem_parts(BwdConfig(), p)["ds"] == 32768
    assert not FAMILY.infeasible_reasons(p, two, H200)  # 193 KB
    assert cfg.deterministic_config(two, p, H200) == BwdConfig(deterministic=True, ds_stages=2)
    with pytest.raises(ConfigError, match="ds_stages=3"):
        BwdConfig(ds_stages=3)


def test_the_deterministic_mode_keeps_the_tuned_tiles_where_the_turn_fits():
    full = Problem(head_dim=64)
    det = cfg.deterministic_config(BwdConfig(dq_tma=True), full, H200)
    assert det == BwdConfig(deterministic=True)
    # 128-row blocks leave no room for the consumers' turn: the first of the default's ladder
    # that has room, there the dQ warp's turn at 128 rows (dQ's GEMM split by rows, S^T and dP^T
    # in halves, dQ staged flat)
    det = cfg.deterministic_config(BwdConfig(tile_m=128, dq_tma=True), full, H200)
    assert det == BwdConfig(
        tile_m=128, deterministic=True, dq_tma=True, ds_stages=2, dq_warp=True, dq_rows=True,
        q_halves=True, dq_flat=True,
    )  # fmt: skip
    assert not FAMILY.infeasible_reasons(full, det, H200)
    already = BwdConfig(tile_n=64, deterministic=True)
    assert cfg.deterministic_config(already, full, H200) is already


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tiles", [(64, 128), (128, 128), (128, 64), (80, 128)])
@pytest.mark.parametrize("seqlens", [(4096, 4096), (1000, 3000), (3000, 1000), (777, 777)])
def test_the_deterministic_order_never_waits_on_a_later_cta(causal, tiles, seqlens):
    """Each Q block's adds are numbered 0, 1, ... over the K blocks that see it; the one before a
    CTA's turn was launched before it (no CTA waits on one that may not be resident yet), and,
    causal, reaches the Q block no later in its own walk (CTAs running side by side do not wait:
    in ascending order every CTA's first add waited for K block 0's walk to its diagonal)."""
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is first imported
    from fa4tune.kernels.fa4_bwd_sm90.kernel import dq_turn, launch_order

    (tile_m, tile_n), (seqlen_q, seqlen_k) = tiles, seqlens
    n_blocks, m_blocks = -(-seqlen_k // tile_n), -(-seqlen_q // tile_m)
    offset = seqlen_k - seqlen_q

    def first_visit(j):  # the first Q block with a query that sees a key of K block j
        if not causal:
            return 0
        last_query = [min((i + 1) * tile_m, seqlen_q) - 1 for i in range(m_blocks)]
        return next((i for i, q in enumerate(last_query) if j * tile_n <= q + offset), m_blocks)

    cta_of = {launch_order(x, seqlen_k, tile_n, True, causal): x for x in range(n_blocks)}
    assert sorted(cta_of) == list(range(n_blocks))
    for i in range(m_blocks):
        visitors = [j for j in range(n_blocks) if first_visit(j) <= i]
        turns = {dq_turn(j, i, seqlen_q, seqlen_k, tile_m, tile_n, causal): j for j in visitors}
        assert sorted(turns) == list(range(len(visitors))), (i, turns)
        for t in range(1, len(visitors)):
            before, this = turns[t - 1], turns[t]
            assert cta_of[before] < cta_of[this]
            if causal:
                assert i - first_visit(before) <= i - first_visit(this)
    # Without the deterministic mode, or the mask, the grid is in K block order.
    assert launch_order(0, seqlen_k, tile_n, False, True) == 0
    assert launch_order(0, seqlen_k, tile_n, True, False) == 0


@pytest.mark.parametrize(
    "grid_x,heads_kv,batch,section",
    [(32, 16, 4, 4), (8, 16, 16, 16), (6, 4, 3, 2), (5, 2, 1, 2), (7, 4, 3, 1), (1, 2, 2, 2)],
)
def test_the_cta_order_takes_each_k_block_of_a_sections_heads_in_turn(
    grid_x, heads_kv, batch, section
):
    """Over the grid (section x the x indices, K/V heads / section, batch) in the order the GPU
    starts it, cta_coords names every (x, K/V head, batch) once: a section's CTAs start with x 0
    of every K/V head of it, then x 1, ...; a section of 1 is the order of a grid of (x, K/V head,
    batch)."""
    import os

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # before cutlass is first imported
    from fa4tune.kernels.fa4_bwd_sm90.kernel import cta_coords

    log2 = section.bit_length() - 1
    order = [
        cta_coords(bx, by, bz, log2)
        for bz in range(batch)
        for by in range(heads_kv // section)
        for bx in range(grid_x * section)
    ]
    assert sorted(order) == sorted(
        (x, h, b) for x in range(grid_x) for h in range(heads_kv) for b in range(batch)
    )
    for start in range(0, heads_kv * batch, section):
        run = order[start * grid_x : (start + section) * grid_x]
        heads = [(p % heads_kv, p // heads_kv) for p in range(start, start + section)]
        assert run == [(x, *head) for x in range(grid_x) for head in heads]
    if section == 1:
        assert order == [
            (x, h, b) for b in range(batch) for h in range(heads_kv) for x in range(grid_x)
        ]


def test_heads_per_section_fill_half_the_l2_causal_only():
    """Causal: the K/V heads whose current query head's Q, dO and fp32 dQ rows fit in half the
    H200's 50 MiB L2, a power of two dividing the K/V heads; otherwise 1."""
    from fa4tune.kernels.fa4_bwd_sm90.launch import heads_per_section

    def section(seqlen, d, hkv, b, causal=True, **knobs):
        problem = Problem(
            batch=b, seqlen_q=seqlen, seqlen_k=seqlen, nheads_q=hkv, nheads_kv=hkv,
            head_dim=d, causal=causal,
        )  # fmt: skip
        return heads_per_section(problem, BwdConfig(**knobs), H200)

    assert section(4096, 128, 16, 4) == 4  # 4 MiB a head: 6 fit
    assert section(1024, 128, 16, 16) == 16  # 1 MiB: 25
    assert section(1024, 64, 32, 16) == 32  # 0.5 MiB: 50
    assert section(16384, 128, 16, 1) == 1  # 16 MiB: 1
    assert section(1024, 64, 2, 8) == 2  # every head of a batch
    assert section(1024, 64, 12, 1) == 4  # 32 fit; the largest power of two dividing 12
    assert section(4096, 128, 16, 4, causal=False) == 1
    assert section(4096, 128, 16, 4, deterministic=True) == 1


# ---- the launch around a kernel played by the CPU ------------------------------------------------
def play_kernel(config: BwdConfig, causal: bool):
    """The CUDA kernel's walk in torch: a CTA per (K block, chunk of the head dim, K/V head,
    batch), its Q blocks from m_block_range, every query head of the group, the masks and formulas
    of kernel.py, bf16 operands for the last three GEMMs as the kernel rounds them. A chunked CTA
    sees Q, dO, K and V with their columns in produce_chunks' order (its chunk first) and computes
    dK, dV and dQ of its chunk from the first chunk of them. persistent: the walks as its CTAs
    take them (walk_coords), three CTAs walking every third (the counter's order is another
    permutation of the same walks), the counter zero at the launch when causal."""
    from fa4tune.kernels.common.dsl import import_dsl

    import_dsl(H200)  # the DSL's first import fixes the arch it builds for: sm_90a
    from fa4tune.kernels.fa4_bwd_sm90.kernel import FlashBackwardSm90, cta_coords

    walk = FlashBackwardSm90.__new__(FlashBackwardSm90)
    walk.tile_m, walk.tile_n, walk.causal = config.tile_m, config.tile_n, causal

    def run(compiled, tensors, semaphore, counter, scale, section=1):
        q, k, v, dout, lse2, dsum, dq_acc, dk, dv = tensors
        batch, seqlen_q, nheads_q, d = q.shape
        seqlen_k, nheads_kv = k.shape[1], k.shape[2]
        group, tm, tn = nheads_q // nheads_kv, config.tile_m, config.tile_n
        scale_log2 = scale * math.log2(math.e)
        dc = cfg.head_dim_chunk(d)
        chunks = d // dc
        if semaphore is not None:  # a turn count per Q block and chunk
            assert semaphore.shape[-1] == -(-seqlen_q // tm) * chunks
        # The CTAs in the order the GPU starts them (linear grid order), each mapped as the kernel
        # maps it (cta_coords): a mapping that missed or repeated a CTA gets wrong gradients here.
        grid = (-(-seqlen_k // tn) * chunks * section, nheads_kv // section, batch)
        count = math.prod(grid)
        coords = [
            (linear % grid[0], linear // grid[0] % grid[1], linear // grid[0] // grid[1])
            for linear in range(count)
        ]
        assert (counter is not None) == (config.persistent and causal)
        if config.persistent:
            assert counter is None or int(counter[0]) == 0
            view = types.SimpleNamespace(shape=(seqlen_k, d, nheads_kv, batch))  # the kernel's K
            ctas = min(count, 3)
            walks = [t for c in range(ctas) for t in range(c, count, ctas)]
            assert walk.walk_count(view, section.bit_length() - 1) == count
            coords = [walk.walk_coords(t, view, section.bit_length() - 1) for t in walks]
        for bx, by, bz in coords:
            x, hk, b = cta_coords(bx, by, bz, section.bit_length() - 1)
            n, c = x // chunks, x % chunks
            # The columns as they lie in shared memory: chunk i holds chunk (c + i) % chunks.
            first = [(c + i) % chunks for i in range(chunks)]
            order = torch.cat([torch.arange(j * dc, j * dc + dc) for j in first])
            mine = slice(c * dc, c * dc + dc)
            keys = torch.arange(n * tn, n * tn + tn)
            kt, vt = (pad(t[b, n * tn : n * tn + tn, hk][:, order], tn) for t in (k, v))
            acc_dk = torch.zeros(tn, dc)
            acc_dv = torch.zeros(tn, dc)
            lo, hi = walk.m_block_range(n, seqlen_q, seqlen_k)
            lo = int(lo) if not isinstance(lo, int) else lo
            for g in range(group):
                h = hk * group + g
                for m in range(lo, hi):
                    rows = slice(m * tm, m * tm + tm)
                    qt, dot = (pad(t[b, rows, h][:, order], tm) for t in (q, dout))
                    at = stat_positions(range(m * tm, m * tm + tm))  # the block's rows
                    lse = lse2[b, h, at]
                    dd = dsum[b, h, at]
                    queries = torch.arange(m * tm, m * tm + tm)
                    s = kt.float() @ qt.float().T  # S^T: (keys, queries)
                    limit = torch.full((tn, tm), seqlen_k)
                    if causal:
                        limit = torch.minimum(limit, (queries + seqlen_k - seqlen_q + 1)[None, :])
                    s = torch.where(keys[:, None] >= limit, -math.inf, s)
                    p = torch.exp2(s * scale_log2 - lse[None, :])
                    dp = vt.float() @ dot.float().T
                    ds = p * (dp * scale - dd[None, :])
                    acc_dv += p.to(BF16).float() @ dot[:, :dc].float()
                    acc_dk += ds.to(BF16).float() @ qt[:, :dc].float()
                    dq = ds.to(BF16).float().T @ kt[:, :dc].float()
                    valid = min(tm, seqlen_q - m * tm)
                    dq_acc[b, m * tm : m * tm + valid, h, mine] += dq[:valid]
            valid = min(tn, seqlen_k - n * tn)
            dk[b, n * tn : n * tn + valid, hk, mine] = acc_dk[:valid].to(dk.dtype)
            dv[b, n * tn : n * tn + valid, hk, mine] = acc_dv[:valid].to(dv.dtype)

    return run


def pad(t, rows: int):
    return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0]))


def stat_positions(rows) -> torch.Tensor:
    """kernel.stat_position of each row: where the preprocessing kernel writes its LSE2 and D."""
    from fa4tune.kernels.fa4_bwd_sm90.kernel import stat_position

    return torch.tensor([stat_position(int(r)) for r in rows], dtype=torch.long)


def play_preprocess(function, dout, out, lse, dlse, lse2, dsum, dq_acc, scale):
    """The preprocessing kernel as the CPU plays it (preprocess.py): D (scaled) and LSE2 of every
    query row, the padding rows 0 and +inf, each row at its stat_position; dQ's accumulator
    zeroed."""
    seqlen_q = dout.shape[1]
    assert dq_acc.dtype == torch.float32 and dq_acc.is_contiguous()
    assert dq_acc.shape[:3] == dout.shape[:3]
    dq_acc.zero_()
    lse2.fill_(math.inf)
    dsum.zero_()
    d = (dout.float() * out.float()).sum(-1).transpose(1, 2)
    at = stat_positions(range(seqlen_q))
    dsum[..., at] = scale * (d - dlse if dlse is not None else d)
    lse2[..., at] = torch.where(lse == -math.inf, math.inf, lse * math.log2(math.e))


@pytest.fixture
def cpu_backward(monkeypatch):
    """attention_backward on CPU tensors: all of it real but the device checks, the compiles and
    the kernels (play_preprocess, play_kernel)."""
    from fa4tune.kernels.fa4_bwd_sm90 import launch

    monkeypatch.setattr(launch, "check_device", lambda *a, **k: None)
    monkeypatch.setattr(launch, "import_dsl", lambda target: None)
    monkeypatch.setattr(launch, "compile_backward", lambda *a, **k: None)
    monkeypatch.setattr(launch, "compile_preprocess", lambda *a, **k: None)
    monkeypatch.setattr(launch, "run_preprocess", play_preprocess)
    monkeypatch.setattr(
        launch, "current_tile_counter", lambda device: torch.zeros(1, dtype=torch.int32)
    )
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    # New floating tensors hold NaN, as the GPU's allocator may hand back anything: the kernels
    # (played) must write all of every buffer the launch allocates, dQ's accumulator included.
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(t):
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: poisoned(empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poisoned(empty_like(*a, **k)))

    def backward(config, causal, *tensors, dlse=None, scale=None):
        monkeypatch.setattr(launch, "run_kernel", play_kernel(config, causal))
        return launch.attention_backward(
            *tensors, config, causal=causal, softmax_scale=scale, dlse=dlse
        )

    return backward


CASES = [
    # (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, causal)
    (2, 100, 100, 4, 4, 64, False),
    (2, 100, 100, 4, 4, 64, True),
    (1, 130, 200, 4, 2, 64, True),  # GQA, more keys than queries, off the tiles
    (1, 200, 70, 6, 2, 64, True),  # fewer keys than queries: the top rows see none (LSE -inf)
    (2, 64, 300, 4, 1, 128, False),  # MQA
    (1, 130, 200, 4, 2, 192, True),  # head dims in chunks: 2 of 96 columns, GQA
    (1, 100, 70, 2, 2, 256, False),  # 2 of 128
]


@pytest.mark.parametrize("batch,sq,sk,hq,hkv,d,causal", CASES)
@pytest.mark.parametrize("config", [BwdConfig(), BwdConfig(tile_n=64, num_stages=1)])
def test_the_launch_and_the_kernels_walk_give_autograds_gradients(
    cpu_backward, config, batch, sq, sk, hq, hkv, d, causal
):
    check_played_gradients(cpu_backward, config, batch, sq, sk, hq, hkv, d, causal)


@pytest.mark.parametrize(
    "batch,sq,sk,hq,hkv,d,causal",
    [c for c in CASES if c[5] <= 128] + [(3, 300, 500, 4, 2, 64, False)],
)
def test_the_persistent_walks_take_every_ctas_walk_once(
    cpu_backward, batch, sq, sk, hq, hkv, d, causal
):
    """persistent: walk_coords maps the walks to the one-walk kernel's CTAs, each once, whatever
    CTA takes them (play_kernel: three CTAs), with or without sections of heads."""
    config = BwdConfig(dq_tma=True, dq_warp=True, persistent=True)
    check_played_gradients(cpu_backward, config, batch, sq, sk, hq, hkv, d, causal)


def check_played_gradients(cpu_backward, config, batch, sq, sk, hq, hkv, d, causal):
    """attention_backward on the CPU (cpu_backward) within 2% of the fp32 reference."""
    g = torch.Generator().manual_seed(sq * 31 + sk)
    q = torch.randn(batch, sq, hq, d, generator=g).to(BF16)
    k = torch.randn(batch, sk, hkv, d, generator=g).to(BF16)
    v = torch.randn(batch, sk, hkv, d, generator=g).to(BF16)
    dout = torch.randn(batch, sq, hq, d, generator=g).to(BF16)
    out, lse = attention_reference(q, k, v, causal=causal)
    dq, dk, dv = cpu_backward(config, causal, dout, q, k, v, out.to(BF16), lse)
    ref = attention_grads_reference(q, k, v, dout, causal=causal)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert got.dtype == BF16 and got.shape == want.shape
        error = ((got.float() - want).norm() / want.norm()).item()
        assert error < 2e-2, (name, error)


SWAP_CASES = [
    (2, 100, 100, 2, 2, 128, False),  # one Q block of 80 and a part one
    (1, 170, 300, 4, 2, 128, True),  # GQA, more keys than queries, off the tiles
    (1, 200, 70, 2, 1, 128, True),  # fewer keys than queries: the top rows see none
]


@pytest.mark.parametrize("batch,sq,sk,hq,hkv,d,causal", SWAP_CASES)
@pytest.mark.parametrize(
    "config",
    [
        BwdConfig(tile_m=80, dq_swap=True, dq_tma=True, dq_warp=True, ds_stages=2),
        BwdConfig(tile_m=80, dq_swap=True, deterministic=True, dq_tma=True, dq_warp=True),
    ],
    ids=lambda c: c.short(),
)
def test_the_walk_of_80_row_q_blocks_gives_autograds_gradients(
    cpu_backward, config, batch, sq, sk, hq, hkv, d, causal
):
    """The launch and the walk at 80 rows a Q block (dq_swap): LSE2 and D padded to 80-row
    blocks, the Q-block ranges and masks, a semaphore per 80-row block. (dQ^T's GEMM gives the
    walk's dQ transposed: the walk computes dQ itself, which is what reaches the accumulator.)"""
    test_the_launch_and_the_kernels_walk_give_autograds_gradients(
        cpu_backward, config, batch, sq, sk, hq, hkv, d, causal
    )


def test_a_gradient_of_the_lse_enters_as_d_minus_dlse(cpu_backward):
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, 80, 2, 64, generator=g).to(BF16) for _ in range(4))
    dlse = torch.randn(1, 2, 80, generator=g)
    out, lse = attention_reference(q, k, v, causal=True, softmax_scale=0.2)
    got = cpu_backward(BwdConfig(), True, dout, q, k, v, out.to(BF16), lse, dlse=dlse, scale=0.2)
    ref = attention_grads_reference(q, k, v, dout, causal=True, softmax_scale=0.2, dlse=dlse)
    for got_t, want in zip(got, ref):
        assert ((got_t.float() - want).norm() / want.norm()).item() < 2e-2


# ---- compiled for sm_90a (slow) -----------------------------------------------------------------
SPREAD = [
    (BwdConfig(), 128, True),
    (BwdConfig(), 128, False),
    (BwdConfig(deterministic=True), 128, True),
    (BwdConfig(deterministic=True, ds_stages=2), 64, True),
    # dQ reductions per warpgroup slice from a producer warp: 2 slices of 64, 32 and 48 columns, one
    (BwdConfig(dq_tma=True, dq_warp=True, ds_stages=2), 128, True),
    (BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, ds_stages=2), 64, True),
    (BwdConfig(dq_tma=True, dq_warp=True), 96, True),
    (BwdConfig(tile_n=64, num_stages=1, dq_tma=True, dq_warp=True), 64, False),
    (BwdConfig(deterministic=True, dq_tma=True, dq_warp=True, ds_stages=2), 128, True),
    (BwdConfig(tile_m=128, deterministic=True, dq_tma=True, dq_warp=True, ds_stages=2), 64, True),
    (BwdConfig(), 96, True),
    (BwdConfig(), 64, False),
    (BwdConfig(tile_n=64, num_stages=1, deterministic=True), 64, True),
    (BwdConfig(dq_tma=True), 128, True),
    (BwdConfig(dq_tma=True), 96, False),
    (BwdConfig(tile_n=64, num_stages=1, dq_tma=True), 64, True),
    (BwdConfig(tile_m=128), 64, False),
    (BwdConfig(tile_m=128, num_stages=1, dq_tma=True), 64, False),
    (BwdConfig(dq_tma=True, ds_stages=2), 128, True),
    (BwdConfig(deterministic=True, ds_stages=2), 64, True),
    (BwdConfig(tile_m=128, ds_stages=2), 64, False),
    # head dims 192 and 256 in chunks of 96 and 128 columns: the defaults, deterministic, the dQ
    # warp over 48-column slices, one warpgroup.
    (BwdConfig(), 192, True),
    (BwdConfig(deterministic=True), 192, False),
    (BwdConfig(num_stages=1, dq_tma=True, dq_warp=True), 192, False),
    (BwdConfig(tile_n=64, dq_tma=True, dq_warp=True, ds_stages=2), 192, True),
    (BwdConfig(num_stages=1), 256, False),
    (BwdConfig(num_stages=1, deterministic=True), 256, True),
    # dQ^T = K^T dS^T (dq_swap): 80-row Q blocks by the dQ warp, consumer-issued TMA reductions,
    # the register adds, the dQ warp's deterministic turn; 64 rows swapped.
    (BwdConfig(tile_m=80, dq_swap=True, dq_tma=True, dq_warp=True, ds_stages=2), 128, False),
    (BwdConfig(tile_m=80, dq_swap=True, dq_tma=True, dq_warp=True, ds_stages=2), 128, True),
    (BwdConfig(tile_m=80, num_stages=1, dq_swap=True, dq_tma=True), 128, False),
    (BwdConfig(tile_m=80, dq_swap=True), 128, True),
    (BwdConfig(tile_m=80, dq_swap=True, deterministic=True, dq_tma=True, dq_warp=True), 128, True),
    (BwdConfig(dq_swap=True, dq_tma=True, dq_warp=True, ds_stages=2), 128, False),
    # S^T and dP^T in halves of the Q block (head dim 64): each dQ path, deterministic.
    (
        BwdConfig(tile_m=128, dq_tma=True, ds_stages=2, dq_warp=True, dq_rows=True, q_halves=True),
        64,
        True,
    ),
    (BwdConfig(tile_m=128, q_halves=True), 64, False),
    (BwdConfig(tile_m=128, num_stages=1, dq_tma=True, q_halves=True), 64, True),
    (
        BwdConfig(tile_m=128, deterministic=True, dq_tma=True, dq_warp=True, q_halves=True),
        64,
        False,
    ),
]


@pytest.mark.compile
@pytest.mark.parametrize("config,head_dim,causal", SPREAD, ids=str)
def test_backward_kernels_compile_without_spills(config, head_dim, causal, capfd, tmp_path):
    import os

    from test_kernel_compile import _serialized_wgmma, _spill_report

    from fa4tune.kernels.fa4_bwd_sm90.compile import compile_backward

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    compiled = compile_backward(
        config,
        "bf16",
        head_dim,
        causal,
        H200,
        options=f"remarks{{ptx}} --keep-ptx --dump-dir {tmp_path}",
        use_cache=False,
    )
    text = "".join(capfd.readouterr())
    report = _spill_report(text)
    assert all(r == (0, 0, 0) for r in report), f"{config.short()} spills: {report}"
    assert not _serialized_wgmma(text), f"{config.short()}: {_serialized_wgmma(text)}"
    ptx = compiled.function.__ptx__
    # The five GEMMs of a step: S^T and dP^T (d/16 each, per part of the Q block), dV and dK
    # (tile_m/16 each), dQ (tile_n/16 for each 64 of its tile_m rows; swapped, each warpgroup's 64
    # columns, or by rows, each warpgroup's 64 rows: tile_n/16).
    dq_gemm = config.tile_n // 16 * (1 if config.dq_swap or config.dq_rows else config.tile_m // 64)
    per_step = config.query_parts * 2 * head_dim // 16 + 2 * config.tile_m // 16 + dq_gemm
    assert ptx.count("wgmma.mma_async") == per_step
    assert ("ld.global.acquire.gpu" in ptx) == config.deterministic
    # dQ: one TMA reduction per Q block, or red.global from every consumer thread.
    assert ("cp.reduce.async.bulk.tensor" in ptx) == config.dq_tma
    # From registers: column pairs, or swapped one value at a time (transposed: rows of dQ apart).
    assert ("red.global.add.v2.f32" in ptx) == (not config.dq_tma and not config.dq_swap)
    assert ("red.global.add.f32" in ptx) == (not config.dq_tma and config.dq_swap)
    # dq_warp: a warpgroup hands its dQ slice over with a named-barrier arrive (not mbarrier's).
    assert bool(re.search(r"(?<!m)bar(?:rier)?\.arrive", ptx)) == config.dq_warp


@pytest.mark.compile
@pytest.mark.parametrize("dq_warp", [False, True])
def test_every_admitted_128_row_config_at_head_dim_64_compiles_without_spills(
    dq_warp, capfd, tmp_path
):
    """What keeps config.KNOWN_SPILLS and the register model's calibration honest: every config at
    the edge the rules admit, built for sm_90a (the dQ warp's apart: they hold no turn)."""
    bad = compile_failures([(config, 64, causal) for config, causal in edge_configs(dq_warp)],
                           capfd, tmp_path)  # fmt: skip
    assert not bad, bad


def admitted_with(knob: str, head_dims, causal: bool = True, off=()) -> list:
    """(config, head_dim) of every config with `knob` on that the rules admit at `head_dims`,
    each other knob over its legal values but those of `off`, left at their defaults."""
    # split_loads and persistent order the loads and the walks (no register or shared-memory
    # rule looks at them), dv_early a GEMM's issue: left at their defaults
    off = tuple(off) + tuple(k for k in ("split_loads", "persistent", "dv_early") if k != knob)
    names = [k for k in cfg.KNOBS if k != knob and k not in off]
    found = []
    for head_dim in head_dims:
        p = Problem(head_dim=head_dim, causal=causal)
        for values in itertools.product(*(cfg.KNOBS[k] for k in names)):
            config = BwdConfig(**dict(zip(names, values)), **{knob: True})
            if not FAMILY.infeasible_reasons(p, config, H200):
                found.append((config, head_dim))
    return found


def halves_configs(causal: bool = True) -> list:
    """Every config with q_halves the rules admit at head dim 64 (deterministic or not; without
    exp2_turns or dq_single: turns_configs, single_configs)."""
    off = ("exp2_turns", "dq_single", "dq_flat", "lse_early")
    return [c for c, _ in admitted_with("q_halves", (64,), causal, off=off)]


def test_q_halves_takes_128_rows_at_head_dim_64_and_reads_the_stats_early():
    """Two parts of 64 queries: 128-row Q blocks at head dim 64 with two warpgroups only (128
    does not fit the registers, ptxas spilled at 96 and with one warpgroup); a part's
    accumulators leave room for its LSE2 and D."""
    halves = BwdConfig(tile_m=128, dq_tma=True, ds_stages=2, dq_warp=True, dq_rows=True,
                       q_halves=True)  # fmt: skip
    assert halves.short() == "128x128s2-tma-w-r-ds2-h2" and halves.query_parts == 2
    assert BwdConfig.from_dict({"tile_m": 128}).q_halves is False  # tables written before it
    p = Problem(head_dim=64, causal=True)
    assert not FAMILY.infeasible_reasons(p, halves, H200)
    assert cfg.stats_in_registers(halves, p) == (True, True)
    assert cfg.stats_in_registers(replace(halves, q_halves=False), p) == (False, False)
    # the register model: S^T and dP^T of a part, P^T and dS^T of the part before
    assert cfg.consumer_registers_needed(halves, p) == 64 + 64 + 32 + 16
    for problem, config, words in [
        (p, replace(halves, tile_m=64, dq_rows=False), "q_halves with tile_m=64"),
        (Problem(head_dim=128), BwdConfig(tile_m=128, q_halves=True), "q_halves at head_dim=128"),
        (Problem(head_dim=96), BwdConfig(tile_m=128, num_stages=1, q_halves=True),
         "q_halves at head_dim=96"),
        (p, BwdConfig(tile_m=128, tile_n=64, q_halves=True), "1 consumer warpgroup(s)"),
    ]:  # fmt: skip
        reasons = FAMILY.infeasible_reasons(problem, config, H200)
        assert any(words in r for r in reasons), (config.short(), reasons)
    # the deterministic turn fits beside the halves (the dQ warp's and the register adds')
    det = cfg.deterministic_config(halves, p, H200)
    assert det == replace(halves, deterministic=True)
    assert len(halves_configs()) == 16 + 12  # 16 searched, 12 deterministic
    from fa4tune.space.backward import BackwardSpace

    assert BackwardSpace.params(None)["q_halves"].choices == (False, True)


def turns_configs() -> list:
    """(config, head_dim) of every exp2_turns config the rules admit at head dims 64, 96 and 128,
    causal."""
    return admitted_with("exp2_turns", (64, 96, 128), off=("dq_flat", "lse_early"))


def test_exp2_turns_take_two_warpgroups_and_no_registers():
    """The warpgroups' turns at the exp2: two consumer warpgroups (tile_n 128), any other knob;
    two named barriers and no registers, so the model and the rules are otherwise unchanged."""
    halves = replace(cfg.DEFAULT_LADDER[0], dq_flat=False)
    turns = replace(halves, exp2_turns=True)
    assert turns.short() == halves.short() + "-xt"
    assert BwdConfig.from_dict({"tile_m": 128}).exp2_turns is False  # tables written before it
    p = Problem(head_dim=64, causal=True)
    assert not FAMILY.infeasible_reasons(p, turns, H200)
    assert cfg.consumer_registers_needed(turns, p) == cfg.consumer_registers_needed(halves, p)
    reasons = FAMILY.infeasible_reasons(p, BwdConfig(tile_n=64, exp2_turns=True), H200)
    assert any("exp2_turns with 1 consumer warpgroup(s)" in r for r in reasons), reasons
    found = turns_configs()
    # every config of two warpgroups the rules admit without the turns, with them
    assert len(found) == 71 + 20 + 55
    assert {d for _, d in found} == {64, 96, 128}
    # a searched knob (it won at head dim 64 non-causal only: kernel-notes, session 50)
    from fa4tune.space.backward import BackwardSpace

    assert BackwardSpace.params(None)["exp2_turns"].choices == (False, True)
    assert "exp2_turns" in BackwardSpace.knobs


def single_configs() -> list:
    """(config, head_dim) of every dq_single config the rules admit at head dims 64 to 256,
    causal."""
    return admitted_with("dq_single", cfg.SUPPORTED_HEAD_DIMS, off=("dq_flat", "lse_early"))


def test_dq_single_takes_the_dq_warp_two_buffers_and_chunks_of_96():
    """dq_single: the first warpgroup computes the whole dQ, the second runs on. The rules keep
    it to what ptxas builds clean: two warpgroups with the dQ warp and two dS^T buffers, dQ's
    GEMM neither split by rows nor swapped, chunks of the head dim of at most 96 columns; no exp2
    turns beside it. The first warpgroup holds the whole dQ (the register model's dQ term)."""
    base = BwdConfig(dq_tma=True, dq_warp=True, ds_stages=2)
    single = replace(base, dq_single=True)
    assert single.short() == base.short() + "-q1"
    assert single.dq_warpgroups == 1 and base.dq_warpgroups == 2
    assert BwdConfig.from_dict({"tile_m": 64}).dq_single is False  # tables written before it
    p96 = Problem(head_dim=96, causal=True)
    assert not FAMILY.infeasible_reasons(p96, single, H200)
    # at 64 rows and head dim 96 the dQ term (48 + 32) equals S^T's and dP^T's (64 + 16)
    assert cfg.consumer_registers_needed(single, p96) == cfg.consumer_registers_needed(base, p96)
    halves = replace(cfg.DEFAULT_LADDER[0], dq_rows=False)
    p64 = Problem(head_dim=64, causal=True)
    assert cfg.consumer_registers_needed(replace(halves, dq_single=True), p64) == (
        cfg.consumer_registers_needed(halves, p64) + 32
    )
    for problem, config, words in [
        (p96, replace(single, dq_warp=False), "dq_single without dq_warp"),
        (p96, replace(single, dq_warp=False, dq_tma=False), "dq_single without dq_warp"),
        (p96, replace(single, ds_stages=1), "dq_single with ds_stages=1"),
        (p96, replace(single, exp2_turns=True), "dq_single with exp2_turns"),
        (p96, replace(single, tile_n=64), "dq_single with 1 consumer warpgroup(s)"),
        (p64, replace(halves, dq_rows=True, dq_single=True), "dq_single with dq_rows"),
        (Problem(head_dim=128), replace(single, dq_swap=True), "dq_single with dq_rows or dq_swap"),
        (Problem(head_dim=128), single, "dq_single at head_dim=128"),
    ]:
        reasons = FAMILY.infeasible_reasons(problem, config, H200)
        assert any(words in r for r in reasons), (config.short(), reasons)
    found = single_configs()
    # 2 stages x deterministic or not x (64 rows; 128 rows, whole or halves) at head dim 64, 64
    # rows at 96; one stage at 192 (shared memory)
    assert sorted({d for _, d in found}) == [64, 96, 192]
    assert len(found) == 12 + 4 + 2
    # a searched knob, and the train jobs probe it (one-knob changes of the default reach it)
    from fa4tune.space.backward import BackwardSpace

    assert BackwardSpace.params(None)["dq_single"].choices == (False, True)
    assert "dq_single" in BackwardSpace.knobs


def test_dq_flat_takes_the_dq_warp_and_the_same_shared_memory():
    """dq_flat: the dQ warp's bulk reductions of slices staged in fragment order. It needs the dQ
    warp; shared memory and registers are as without it, so every config of the dQ warp admits
    it, dQ's GEMM swapped or not (dQ^T's slabs: the Q block's rows by 64 columns)."""
    flat = cfg.DEFAULT_LADDER[0]
    base = replace(flat, dq_flat=False)
    assert flat.short() == base.short() + "-fl"
    assert BwdConfig.from_dict({"tile_m": 64}).dq_flat is False  # tables written before it
    p64 = Problem(head_dim=64, causal=True)
    assert not FAMILY.infeasible_reasons(p64, flat, H200)
    assert cfg.smem_parts(flat, p64) == cfg.smem_parts(base, p64)
    assert cfg.consumer_registers_needed(flat, p64) == cfg.consumer_registers_needed(base, p64)
    for problem, config, words in [
        (p64, BwdConfig(dq_tma=True, dq_flat=True), "dq_flat without dq_warp"),
        (p64, BwdConfig(dq_flat=True), "dq_flat without dq_warp"),
    ]:
        reasons = FAMILY.infeasible_reasons(problem, config, H200)
        assert any(words in r for r in reasons), (config.short(), reasons)
    for head_dim in (64, 96, 128, 192):
        p = Problem(head_dim=head_dim, causal=True)
        warp = [c for c, _ in admitted_with("dq_warp", (head_dim,), off=("dq_flat", "lse_early"))]
        assert warp
        for config in warp:
            assert not FAMILY.infeasible_reasons(p, replace(config, dq_flat=True), H200)
    # the slabs: 64 rows by the warpgroup's columns, or dQ^T's whole slice
    swap = BwdConfig(tile_m=80, dq_tma=True, ds_stages=2, dq_warp=True, dq_swap=True)
    assert cfg.flat_slab(replace(swap, dq_flat=True), 128) == (80, 64, True)
    assert cfg.flat_slab(flat, 64) == (64, 64, False)
    assert cfg.flat_slab(replace(base, dq_rows=False, dq_flat=True), 64) == (64, 32, False)
    # searched, and the default at head dims 64 and 96 (1.026-1.098x, kernel-notes, session 52)
    from fa4tune.space.backward import BackwardSpace

    assert "dq_flat" in BackwardSpace.knobs
    assert BackwardSpace.params(None)["dq_flat"].choices == (False, True)
    assert [c.dq_flat for c in cfg.DEFAULT_LADDER].count(True) == 3


LSE_EARLY = BwdConfig(tile_m=80, dq_tma=True, dq_warp=True, ds_stages=2, dq_swap=True,
                     dq_flat=True, lse_early=True)  # fmt: skip


def test_lse_early_takes_80_rows_flat_and_swapped_without_the_mask():
    """lse_early holds LSE2 in registers where the register model finds no room: taken only
    where ptxas built it without spills (head dim 128, 80 rows, dQ swapped and flat, neither
    causal nor deterministic nor exp2_turns), refused where the model keeps LSE2 in registers
    anyway."""
    p = Problem(head_dim=128)
    assert LSE_EARLY.short().endswith("-fl-le")
    assert BwdConfig.from_dict({"tile_m": 80}).lse_early is False  # tables written before it
    assert not FAMILY.infeasible_reasons(p, LSE_EARLY, H200)
    assert cfg.stats_in_registers(LSE_EARLY, p)[0]
    assert not cfg.stats_in_registers(replace(LSE_EARLY, lse_early=False), p)[0]
    for problem, config, words in [
        (Problem(head_dim=128, causal=True), LSE_EARLY, "only at head dim 128"),
        (p, replace(LSE_EARLY, dq_flat=False), "only at head dim 128"),
        (p, replace(LSE_EARLY, deterministic=True), "only at head dim 128"),
        (p, replace(LSE_EARLY, exp2_turns=True), "only at head dim 128"),
        (p, replace(LSE_EARLY, tile_m=64), "the same kernel"),
    ]:  # fmt: skip
        reasons = FAMILY.infeasible_reasons(problem, config, H200)
        assert any(words in r for r in reasons), (config.short(), reasons)


@pytest.mark.compile
def test_lse_early_compiles_without_spills(capfd, tmp_path):
    """What keeps lse_early's rule honest: every config of it the rules admit (one and two Q
    stages and dS^T buffers) built for sm_90a at head dim 128, non-causal (with exp2_turns
    ptxas spilled 4 bytes: refused)."""
    cases = [(c, 128, False) for c, _ in admitted_with("lse_early", (128,), causal=False)]
    assert LSE_EARLY in [c for c, _, _ in cases]
    bad = compile_failures(cases, capfd, tmp_path)
    assert not bad, bad


def with_knob_on_the_ladder(knob: str, suffix: str, rungs) -> list:
    """(rung, the rung with `knob` on) for each (head dim, rung index) of `rungs`: its short name
    the rung's and `suffix`, admitted causal and not wherever the rung is."""
    pairs = []
    for head_dim, rung in rungs:
        base = cfg.DEFAULT_LADDER[rung]
        on = replace(base, **{knob: True})
        assert on.short() == base.short() + suffix
        for causal in (False, True):
            p = Problem(head_dim=head_dim, causal=causal)
            if not FAMILY.infeasible_reasons(p, base, H200):
                assert not FAMILY.infeasible_reasons(p, on, H200), (on.short(), head_dim, causal)
        pairs.append((base, on))
    return pairs


def test_split_loads_takes_the_head_dims_a_cta_holds_whole():
    """K, V, Q and dO on barriers of their own: any config at head dims up to 128 (the loads'
    order, no registers or shared memory the rules count), not with the head dim in chunks."""
    with_knob_on_the_ladder("split_loads", "-sl", ((64, 0), (128, 3), (128, 4), (96, 5)))
    assert BwdConfig.from_dict({"tile_m": 80}).split_loads is False  # tables written before it
    for head_dim in (192, 256):
        config = BwdConfig(num_stages=1, split_loads=True)
        reasons = FAMILY.infeasible_reasons(Problem(head_dim=head_dim), config, H200)
        assert any(f"split_loads at head_dim={head_dim}" in r for r in reasons), reasons
        assert not FAMILY.infeasible_reasons(
            Problem(head_dim=head_dim), replace(config, split_loads=False), H200
        )
    from fa4tune.space.backward import BackwardSpace

    assert "split_loads" in BackwardSpace.knobs
    assert BackwardSpace.params(None)["split_loads"].choices == (False, True)


# A spread of split_loads configs: each default rung at its head dim, the deterministic dQ warp,
# one consumer warpgroup, one stage, the exp2 turns (config, head dim, causal).
SPLIT_LOADS_BUILDS = [
    (replace(cfg.DEFAULT_LADDER[0], split_loads=True), 64, True),
    (replace(cfg.DEFAULT_LADDER[0], split_loads=True, deterministic=True), 64, False),
    (replace(cfg.DEFAULT_LADDER[3], split_loads=True), 128, False),
    (replace(cfg.DEFAULT_LADDER[4], split_loads=True), 128, True),
    (replace(cfg.DEFAULT_LADDER[5], split_loads=True), 96, True),
    (BwdConfig(tile_n=64, num_stages=1, dq_tma=True, split_loads=True), 64, True),
    (replace(cfg.DEFAULT_LADDER[0], exp2_turns=True, dq_flat=False, split_loads=True), 64, False),
]


@pytest.mark.compile
def test_split_loads_compiles_without_spills(capfd, tmp_path):
    """The barriers' waits take no registers the model counts: a spread of split_loads configs
    built for sm_90a without spills or serialized wgmma."""
    bad = admitted_build_failures(SPLIT_LOADS_BUILDS, capfd, tmp_path)
    assert not bad, bad


def test_persistent_takes_the_dq_warps_configs_of_a_whole_head_dim():
    """One CTA per SM walking the K blocks: any config with the dQ warp at head dims up to 128,
    causal or not (its loop state fits the registers the model counts: compile test below), not
    deterministic (a turn could wait on the CTA's own later walk), not with split_loads, the
    consumers' own dQ paths, or the head dim in chunks; the deterministic mode of a persistent
    config walks once."""
    rungs = ((64, 0), (64, 2), (128, 4), (96, 5), (128, 6))
    for base, walking in with_knob_on_the_ladder("persistent", "-ps", rungs):
        assert walking.as_deterministic() == replace(base.as_deterministic(), persistent=False)
    assert BwdConfig.from_dict({"tile_m": 80}).persistent is False  # tables written before it
    p = Problem(head_dim=64)
    walking = replace(cfg.DEFAULT_LADDER[0], persistent=True)
    for change, words in (
        (dict(deterministic=True), "persistent with deterministic"),
        (dict(split_loads=True), "persistent with split_loads"),
        (dict(dq_warp=False, dq_rows=False, dq_flat=False), "persistent without dq_warp"),
        (dict(exp2_turns=True, dq_flat=False), "persistent with exp2_turns"),
    ):
        reasons = FAMILY.infeasible_reasons(p, replace(walking, **change), H200)
        assert any(words in r for r in reasons), (change, reasons)
    lse_early = replace(cfg.DEFAULT_LADDER[3], persistent=True)  # the 80-row hd128 default
    reasons = FAMILY.infeasible_reasons(Problem(head_dim=128), lse_early, H200)
    assert any("persistent with lse_early" in r for r in reasons), reasons
    for head_dim in (192, 256):
        config = BwdConfig(tile_n=64, num_stages=1, dq_tma=True, dq_warp=True, persistent=True)
        reasons = FAMILY.infeasible_reasons(Problem(head_dim=head_dim), config, H200)
        assert any(f"persistent at head_dim={head_dim}" in r for r in reasons), reasons
        reasons = FAMILY.infeasible_reasons(
            Problem(head_dim=head_dim), replace(config, persistent=False), H200
        )
        assert not any("persistent" in r for r in reasons), reasons
    from fa4tune.space.backward import BackwardSpace

    assert "persistent" in BackwardSpace.knobs
    assert BackwardSpace.params(None)["persistent"].choices == (False, True)


# A spread of persistent configs: each default rung with the dQ warp at its head dim (the 80-row
# one without lse_early), causal (the walks' counter) and not (a fixed stride), one consumer
# warpgroup (config, head dim, causal).
PERSISTENT_BUILDS = [
    (replace(cfg.DEFAULT_LADDER[0], persistent=True), 64, False),
    (replace(cfg.DEFAULT_LADDER[0], persistent=True), 64, True),
    (replace(cfg.DEFAULT_LADDER[2], persistent=True), 64, True),
    (replace(cfg.DEFAULT_LADDER[3], lse_early=False, persistent=True), 128, False),
    (replace(cfg.DEFAULT_LADDER[4], persistent=True), 128, True),
    (replace(cfg.DEFAULT_LADDER[5], persistent=True), 96, True),
    (BwdConfig(tile_n=64, num_stages=1, dq_tma=True, dq_warp=True, persistent=True), 64, True),
]


@pytest.mark.compile
def test_persistent_compiles_without_spills(capfd, tmp_path):
    """The walks' loop state takes no registers the model counts: a spread of persistent configs
    built for sm_90a without spills or serialized wgmma; the causal ones take their walks from
    the counter (one atomic add a walk), the others not."""
    bad = admitted_build_failures(PERSISTENT_BUILDS, capfd, tmp_path)
    assert not bad, bad
    from fa4tune.kernels.fa4_bwd_sm90.compile import compile_backward

    for config, head_dim, causal in PERSISTENT_BUILDS[:2]:
        ptx = compile_backward(
            config, "bf16", head_dim, causal, H200,
            options=f"--keep-ptx --dump-dir {tmp_path}", use_cache=False,
        ).function.__ptx__  # fmt: skip
        assert bool(re.search(r"atom(\.\w+)*\.add", ptx)) == causal, (config.short(), causal)


def test_dv_early_takes_dq_flat_and_counts_p_in_bf16():
    """dV's GEMM before dS^T: with dq_flat (ptxas spilled without it, session 65); P^T's bf16
    registers live beside S^T and dP^T, so 80 rows at head dim 128 no longer fit, 64 do, and a
    part's with q_halves (the last part's dV goes early)."""
    swapped = replace(cfg.DEFAULT_LADDER[4], dq_flat=True)  # the 64-row hd128 rung, flat
    on = replace(swapped, dv_early=True)
    assert on.short() == "64x128s2-tma-w-sw-ds2-fl-ve"
    assert BwdConfig.from_dict({"tile_m": 80}).dv_early is False  # tables written before it
    hd128 = Problem(head_dim=128, causal=True)
    assert cfg.consumer_registers_needed(on, hd128) == (
        cfg.consumer_registers_needed(swapped, hd128) + 64 // 4
    )
    # LSE2 is read before the exp2, P^T made after it: the room for LSE2 early stays
    assert cfg.stats_in_registers(on, hd128) == cfg.stats_in_registers(swapped, hd128)
    halves = cfg.DEFAULT_LADDER[0]  # the hd64 default
    hd64 = Problem(head_dim=64, causal=True)
    assert cfg.consumer_registers_needed(replace(halves, dv_early=True), hd64) == (
        cfg.consumer_registers_needed(halves, hd64) + 128 // 8
    )
    for head_dim, rung in ((128, 4), (96, 5), (64, 6), (64, 0)):
        base = replace(cfg.DEFAULT_LADDER[rung], dq_flat=True)
        for causal in (False, True):
            p = Problem(head_dim=head_dim, causal=causal)
            reasons = FAMILY.infeasible_reasons(p, replace(base, dv_early=True), H200)
            assert not reasons, (base.short(), head_dim, causal, reasons)
    for problem, config, words in [
        (hd128, replace(on, dq_flat=False), "dv_early without dq_flat"),
        (Problem(head_dim=128), replace(cfg.DEFAULT_LADDER[3], lse_early=False, dv_early=True),
         "consumer threads need about"),
        (hd128, replace(on, persistent=True), "dv_early with persistent at head dim 128"),
        (Problem(head_dim=64), BwdConfig(tile_n=64, dq_tma=True, dq_warp=True, dq_flat=True,
                                         persistent=True, dv_early=True),
         "with 1 consumer warpgroup(s)"),
    ]:  # fmt: skip
        reasons = FAMILY.infeasible_reasons(problem, config, H200)
        assert any(words in r for r in reasons), (config.short(), reasons)
    from fa4tune.space.backward import BackwardSpace

    assert "dv_early" in BackwardSpace.knobs
    assert BackwardSpace.params(None)["dv_early"].choices == (False, True)


# A spread of dv_early configs: the 64-row swapped hd128 rung with dq_flat, causal and not,
# deterministic; hd96's dq_single rung, persistent too; hd64's halves, causal and not, persistent
# and deterministic; hd64 at 64 rows, persistent too, one stage with the exp2 turns (config, head
# dim, causal).
DV_EARLY_BUILDS = [
    (replace(cfg.DEFAULT_LADDER[0], dv_early=True), 64, True),
    (replace(cfg.DEFAULT_LADDER[0], dv_early=True), 64, False),
    (replace(cfg.DEFAULT_LADDER[0], persistent=True, dv_early=True), 64, True),
    (replace(cfg.DEFAULT_LADDER[0], deterministic=True, dv_early=True), 64, False),
    (replace(cfg.DEFAULT_LADDER[4], dq_flat=True, dv_early=True), 128, True),
    (replace(cfg.DEFAULT_LADDER[4], dq_flat=True, dv_early=True), 128, False),
    (replace(cfg.DEFAULT_LADDER[4], dq_flat=True, deterministic=True, dv_early=True), 128, True),
    (replace(cfg.DEFAULT_LADDER[5], dv_early=True), 96, True),
    (replace(cfg.DEFAULT_LADDER[5], persistent=True, dv_early=True), 96, False),
    (replace(cfg.DEFAULT_LADDER[6], dq_flat=True, dv_early=True), 64, True),
    (replace(cfg.DEFAULT_LADDER[6], dq_flat=True, persistent=True, dv_early=True), 64, True),
    (BwdConfig(num_stages=1, dq_tma=True, dq_warp=True, dq_flat=True, exp2_turns=True,
               dv_early=True), 64, False),
]  # fmt: skip


@pytest.mark.compile
def test_dv_early_compiles_without_spills_and_issues_dv_before_ds(capfd, tmp_path):
    """A spread of dv_early configs built for sm_90a without spills or serialized wgmma. In the
    PTX of the whole block, the step's first GEMM with its A operand in registers (dV's: P^T)
    comes before the first stmatrix (dS^T's) with the knob, after it without; with the halves the
    first part's dV still follows its dS^T. Either way the wait for the last part's dP^T leaves
    one more GEMM in flight (dV): one `wgmma.wait_group k` becomes k + 1."""
    bad = admitted_build_failures(DV_EARLY_BUILDS, capfd, tmp_path)
    assert not bad, bad
    from collections import Counter

    from fa4tune.kernels.fa4_bwd_sm90.compile import compile_backward

    register_a = re.compile(r"wgmma\.mma_async.*\}\s*,\s*\{")  # {accumulators}, {A}
    # (config, head dim, causal, the last part's wait for dP^T without the knob)
    for (config, head_dim, causal), k in ((DV_EARLY_BUILDS[4], 0), (DV_EARLY_BUILDS[0], 2)):
        waits = {}
        for early in (False, True):
            ptx = compile_backward(
                replace(config, dv_early=early), "bf16", head_dim, causal, H200,
                options=f"--keep-ptx --dump-dir {tmp_path}", use_cache=False,
            ).function.__ptx__  # fmt: skip
            lines = ptx.splitlines()
            first_rs = next(i for i, line in enumerate(lines) if register_a.search(line))
            first_stmatrix = next(i for i, line in enumerate(lines) if "stmatrix" in line)
            whole_and_early = early and not config.q_halves
            assert (first_rs < first_stmatrix) == whole_and_early, (config.short(), early)
            waits[early] = Counter(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx))
        assert waits[True] - waits[False] == Counter({str(k + 1): 1}), (config.short(), waits)
        assert waits[False] - waits[True] == Counter({str(k): 1}), (config.short(), waits)


def test_the_flat_order_is_each_warpgroups_fragment_order():
    """config.flat_dq_offset: a bijection of a 64 x width slice, each thread's four values of an
    8-column group side by side (one 16-byte store), a warp's 32 fours contiguous, and what the
    cast's torch equivalent (a view and a permute of the slice's dims) reads back."""
    for width in (48, 64, 96, 128):
        slice_ = torch.arange(64 * width).reshape(64, width)
        offsets = torch.tensor(
            [[cfg.flat_dq_offset(r, c, width) for c in range(width)] for r in range(64)]
        )
        assert sorted(offsets.flatten().tolist()) == list(range(64 * width))
        # thread t = 32 w + 4 r + c holds rows 16 w + r (+ 8) and columns 8 j + 2 c (+ 1)
        t, j = 32 * 2 + 4 * 5 + 3, 1
        row, col = 16 * 2 + 5, 8 * j + 2 * 3
        assert [offsets[row, col], offsets[row, col + 1], offsets[row + 8, col],
                offsets[row + 8, col + 1]] == [j * 512 + 4 * t + i for i in range(4)]  # fmt: skip
        flat = torch.empty(64 * width, dtype=torch.long)
        flat[offsets.flatten()] = slice_.flatten()
        # the flat memory as (j, warp, r, c, h, e), permuted to rows (warp, h, r) x cols (j, c, e)
        back = flat.view(width // 8, 4, 8, 4, 2, 2).permute(1, 4, 2, 0, 3, 5).reshape(64, width)
        assert torch.equal(back, slice_)
    # dq_swap's slabs: dQ^T's accumulator, 64 rows (dQ's columns) by the Q block's rows; dQ's
    # (q, k) at flat_dq_offset(k, q, rows): the cast test's permute of dQ's (j, c, e) x (w, h, r)
    for rows in (64, 80):
        slab = torch.arange(rows * 64).reshape(rows, 64)
        flat = torch.empty(rows * 64, dtype=torch.long)
        for q in range(rows):
            for k in range(64):
                flat[cfg.flat_dq_offset(k, q, rows)] = slab[q, k]
        permuted = slab.view(rows // 8, 4, 2, 4, 2, 8).permute(0, 3, 5, 1, 4, 2).flatten()
        assert torch.equal(permuted, flat)
    with pytest.raises(AssertionError):
        cfg.flat_dq_offset(64, 0, 64)


def flat_configs() -> list:
    """(config, head_dim) of the default ladder's rungs with dq_flat where the rules admit it,
    causal, at head dims 64, 96, 128 and 192, and their deterministic forms."""
    found = []
    # with dQ's GEMM swapped at 80 rows too (dQ^T's slabs of 80 rows)
    swap80 = BwdConfig(tile_m=80, dq_tma=True, ds_stages=2, dq_warp=True, dq_swap=True)
    for head_dim in (64, 96, 128, 192):
        p = Problem(head_dim=head_dim, causal=True)
        for config in (*cfg.DEFAULT_LADDER, swap80):
            for flat in (
                replace(config, dq_flat=True),
                replace(config, dq_flat=True).as_deterministic(),
            ):
                if not FAMILY.infeasible_reasons(p, flat, H200) and (flat, head_dim) not in found:
                    found.append((flat, head_dim))
    return found


@pytest.mark.compile
def test_the_default_ladder_with_dq_flat_compiles_without_spills(capfd, tmp_path):
    """dq_flat's staging and bulk reductions built for sm_90a on the default ladder's rungs that
    admit it, deterministic or not: no spills or serialized wgmma, the bulk reductions without a
    tensor map, dQ staged by 16-byte shared stores."""
    import os

    from test_kernel_compile import _serialized_wgmma, _spill_report

    from fa4tune.kernels.fa4_bwd_sm90.compile import compile_backward

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    cases = flat_configs()
    assert {d for _, d in cases} == {64, 96, 128} and len(cases) >= 12
    bad = []
    for config, head_dim in cases:
        compiled = compile_backward(
            config, "bf16", head_dim, True, H200,
            options=f"remarks{{ptx}} --keep-ptx --dump-dir {tmp_path}", use_cache=False,
        )  # fmt: skip
        text = "".join(capfd.readouterr())
        ptx = compiled.function.__ptx__
        if (
            any(r != (0, 0, 0) for r in _spill_report(text))
            or _serialized_wgmma(text)
            or "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" not in ptx
            or "cp.reduce.async.bulk.tensor" in ptx
            or not re.search(r"st\.shared\.v4\.[bf]32", ptx)
        ):
            bad.append((config.short(), head_dim, _spill_report(text)))
    assert not bad, bad


@pytest.mark.compile
@pytest.mark.parametrize(
    "head_dim,slab",
    [(64, (64, 32, False)), (64, (64, 64, False)), (96, (64, 48, False)), (96, (64, 96, False)),
     (128, (64, 64, False)), (128, (64, 64, True)), (128, (80, 64, True)), (256, (80, 64, True))],
)  # fmt: skip
def test_the_flat_cast_compiles_without_spills(head_dim, slab, capfd, tmp_path):
    import os

    from test_kernel_compile import _spill_report

    from fa4tune.kernels.common.dsl import dynamic_tensor, import_dsl
    from fa4tune.kernels.fa4_bwd_sm90.compile import compile_postprocess

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    assert compile_postprocess("bf16", head_dim, slab, H200) is not None  # the launch's
    cute = import_dsl(H200)
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    from fa4tune.kernels.fa4_bwd_sm90.kernel import DTYPES
    from fa4tune.kernels.fa4_bwd_sm90.postprocess import FlatDqCast

    args = (dynamic_tensor(cutlass.Float32, 4, 16), dynamic_tensor(DTYPES["bf16"], 4, 16),
            make_fake_stream())  # fmt: skip
    compiled = cute.compile(
        FlatDqCast("bf16", head_dim, *slab), *args,
        options=f"remarks{{ptx}} --keep-ptx --dump-dir {tmp_path}",
    )  # fmt: skip
    report = _spill_report("".join(capfd.readouterr()))
    assert all(r == (0, 0, 0) for r in report), report
    ptx = compiled.__ptx__
    rows, cols, transposed = slab
    groups = (rows if transposed else cols) // 8  # of the 64-row accumulator's columns
    # a 16-byte load per 8-column group, then the shared stores (dQ's accumulator: a 4-byte one
    # per row of a group, dQ^T's: a 2-byte one per value), the CTA's barrier, and each thread's
    # 8-column pieces of the slab (over 128 threads): a 16-byte shared load and store each
    count = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    assert count(r"\n\s*ld(?:\.global)?\.v4\.[bf]32") == groups
    if transposed:
        assert count(r"\n\s*st\.shared\.b16") == 4 * groups
    else:
        assert count(r"\n\s*st\.shared\.b32") == 2 * groups
    assert count(r"\n\s*bar\.sync") == 1
    pieces = -(-rows * cols // 8 // 128)
    assert count(r"\n\s*ld\.shared\.v4\.b32") == pieces
    assert count(r"\n\s*st(?:\.global)?\.v4\.b32") == pieces
    # every global load before the first shared store, every shared store before the barrier
    first_store = re.search(r"\n\s*st\.shared", ptx).start()
    assert first_store > max(m.start() for m in re.finditer(r"\n\s*ld(?:\.global)?\.v4\.[bf]", ptx))
    barrier = re.search(r"\n\s*bar\.sync", ptx).start()
    assert barrier > max(m.start() for m in re.finditer(r"\n\s*st\.shared", ptx))
    with pytest.raises(ValueError, match="multiple of 8"):
        FlatDqCast("bf16", 96, 64, 36)
    with pytest.raises(ValueError, match="64-row accumulator"):
        FlatDqCast("bf16", 128, 80, 64)  # 80 rows only as dQ^T's


def test_the_train_jobs_probe_dq_single_at_head_dims_64_and_96():
    """The probes (one-knob changes of the default, measured right after it) reach dq_single, the
    space's last knob, on every problem that admits it: a 22-second search measures about 20
    configs, of which the sampler alone would pick dq_single's two at head dim 96 by chance."""
    from pathlib import Path

    from fa4tune.space import compose
    from fa4tune.target import get_target
    from fa4tune.tune.job import load_job

    root = Path(__file__).resolve().parents[1]
    for name, target in (("h100-bf16-train", "H100-SXM"), ("h200-bf16-train", "H200")):
        job = load_job(str(root / "tuning_configs" / f"{name}.yaml"))
        space = compose(job.kernel, job.spaces)
        probed = {
            p.head_dim
            for p in job.problems
            for params in space.probes(p, get_target(target), job.probes)
            if params.get("dq_single")
        }
        assert probed == {64, 96}, (name, probed)


def test_the_train_jobs_probe_dq_flat_on_every_problem():
    """dq_flat, the space's last knob and the default at head dims 64 and 96: every problem of
    both train jobs measures the other side of it among its probes."""
    from pathlib import Path

    from fa4tune.space import compose
    from fa4tune.target import get_target
    from fa4tune.tune.job import load_job

    root = Path(__file__).resolve().parents[1]
    for name, target in (("h100-bf16-train", "H100-SXM"), ("h200-bf16-train", "H200")):
        job = load_job(str(root / "tuning_configs" / f"{name}.yaml"))
        space, target = compose(job.kernel, job.spaces), get_target(target)
        for p in job.problems:
            default = space.default_params(p, target)["dq_flat"]
            flat = p.head_dim in (64, 96) or (p.head_dim == 128 and not p.causal)
            assert default == flat, (name, p.key())
            probes = space.probes(p, target, job.probes)
            assert any(params["dq_flat"] != default for params in probes), (name, p.key())


@pytest.mark.compile
def test_every_admitted_dq_single_config_compiles_without_spills(capfd, tmp_path):
    """What keeps dq_single's rules honest: every config of it they admit, causal, built for
    sm_90a without spills or serialized wgmma."""
    bad = compile_failures([(c, d, True) for c, d in single_configs()], capfd, tmp_path)
    assert not bad, bad


@pytest.mark.compile
def test_the_default_ladder_with_exp2_turns_compiles_without_spills(capfd, tmp_path):
    """The barriers around the exp2, built for sm_90a on the default ladder's configs of two
    warpgroups at head dims 64, 96 and 128, causal (every admitted config built once offline, 146,
    kernel-notes session 49)."""
    cases = [
        (replace(c, exp2_turns=True), d, True)
        for c in cfg.DEFAULT_LADDER for d in (64, 96, 128)
        if c.consumer_warpgroups == 2
        and not FAMILY.infeasible_reasons(Problem(head_dim=d, causal=True),
                                          replace(c, exp2_turns=True), H200)
    ]  # fmt: skip
    assert len(cases) >= 12
    bad = compile_failures(cases, capfd, tmp_path)
    assert not bad, bad


@pytest.mark.compile
def test_every_admitted_halves_config_compiles_without_spills(capfd, tmp_path):
    """What keeps the register model of q_halves honest: every config of it the rules admit at
    head dim 64, causal (the mask's bounds take registers), built for sm_90a."""
    bad = compile_failures([(c, 64, True) for c in halves_configs()], capfd, tmp_path)
    assert not bad, bad


@pytest.mark.compile
def test_every_admitted_80_row_config_compiles_without_spills(capfd, tmp_path):
    """What keeps config.SWAP_OVERHEAD_REGS honest: every dq_swap config at 80 rows the rules
    admit (head dim 128), built for sm_90a."""
    bad = compile_failures([(c, 128, causal) for c, causal in swap_edge_configs()], capfd, tmp_path)
    assert not bad, bad


def compile_failures(cases, capfd, tmp_path) -> list:
    """(config, head_dim, causal, spill report) of each case of (config, head_dim, causal) that,
    built for sm_90a, spills or has ptxas serialize its wgmma."""
    import os

    from test_kernel_compile import _serialized_wgmma, _spill_report

    from fa4tune.kernels.fa4_bwd_sm90.compile import compile_backward

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    bad = []
    for config, head_dim, causal in cases:
        compile_backward(
            config, "bf16", head_dim, causal, H200,
            options=f"remarks{{ptx}} --dump-dir {tmp_path}", use_cache=False,
        )  # fmt: skip
        text = "".join(capfd.readouterr())
        if any(r != (0, 0, 0) for r in _spill_report(text)) or _serialized_wgmma(text):
            bad.append((config.short(), head_dim, causal, _spill_report(text)))
    return bad


def admitted_build_failures(cases, capfd, tmp_path) -> list:
    """compile_failures of cases of (config, head_dim, causal) that the rules must admit: each
    admitted (asserted) before it is built."""
    for config, head_dim, causal in cases:
        assert not FAMILY.infeasible_reasons(
            Problem(head_dim=head_dim, causal=causal), config, H200
        ), config.short()
    return compile_failures(cases, capfd, tmp_path)


def shipped_backward_configs():
    """(config, head_dim, causal) of every entry of the shipped backward tables, once each."""
    from fa4tune.runtime.lookup import PACKAGE_TABLES
    from fa4tune.runtime.tables import read_table

    tables = [read_table(path) for path in sorted(PACKAGE_TABLES.glob("*.yaml"))]
    found = {
        (BwdConfig.from_dict(e["config"]), e["problem"]["head_dim"], e["problem"]["causal"])
        for t in tables if t["kernel"] == FAMILY.name for e in t["entries"]
    }  # fmt: skip
    return sorted(found, key=str)


@pytest.mark.compile
def test_every_shipped_backward_config_compiles_without_spills(capfd, tmp_path):
    """What autograd's backward runs from the shipped tables, built for sm_90a."""
    shipped = shipped_backward_configs()
    assert shipped
    bad = compile_failures(shipped, capfd, tmp_path)
    assert not bad, bad


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("has_dlse", [False, True])
def test_the_preprocessing_kernel_compiles_without_spills(head_dim, has_dlse, capfd, tmp_path):
    import os

    from test_kernel_compile import _spill_report

    from fa4tune.kernels.common.dsl import dynamic_tensor, import_dsl
    from fa4tune.kernels.fa4_bwd_sm90.compile import compile_preprocess

    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    cute = import_dsl(H200)
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    from fa4tune.kernels.fa4_bwd_sm90.kernel import DTYPES
    from fa4tune.kernels.fa4_bwd_sm90.preprocess import BackwardPreprocess, row_lanes

    assert compile_preprocess("bf16", head_dim, head_dim, has_dlse, H200) is not None  # launch's
    f32, elem = cutlass.Float32, DTYPES["bf16"]
    args = (dynamic_tensor(elem, 4, 16), dynamic_tensor(elem, 4, 16), dynamic_tensor(f32, 3, 4),
            dynamic_tensor(f32, 3, 4) if has_dlse else None, dynamic_tensor(f32, 3, 16),
            dynamic_tensor(f32, 3, 16), dynamic_tensor(f32, 4, 16), f32(1.0),
            make_fake_stream())  # fmt: skip
    compiled = cute.compile(
        BackwardPreprocess("bf16", head_dim, head_dim, has_dlse), *args,
        options=f"remarks{{ptx}} --keep-ptx --dump-dir {tmp_path}",
    )  # fmt: skip
    report = _spill_report("".join(capfd.readouterr()))
    assert all(r == (0, 0, 0) for r in report), report
    ptx = compiled.__ptx__
    lanes = row_lanes(head_dim)
    assert lanes in (8, 16, 32) and lanes * 8 >= head_dim > lanes * 4
    # a lane's 8 columns of dO and of O in one 16-byte load each (no scalar 16-bit loads), its
    # 16-byte vectors of the accumulator's zeros, a butterfly over the row's lanes, and D and LSE2
    # (and the padding's) as scalars
    assert ptx.count("ld.global.v4.b32") == 2 and "ld.global.b16" not in ptx
    assert ptx.count("st.global.v4.b32") == -(-head_dim // 4 // lanes)
    assert ptx.count("shfl.sync.bfly") == lanes.bit_length() - 1
    assert ptx.count("st.global.b32") == 4
    assert ptx.count("ld.global.b32") == 1 + has_dlse  # the row's LSE (and dLSE)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("batch,nheads,padded", [(2, 3, 80), (1, 16, 128), (3, 5, 64), (2, 1, 256)])
def test_the_preprocessing_kernels_warps_take_one_sector_of_the_stats(
    head_dim, batch, nheads, padded
):
    """preprocess.row_coords: every (batch, head, query) row once, and the D and LSE2 words a
    warp writes (each row's at its stat_position in (batch, heads, padded) fp32) in one 32-byte
    sector."""
    from fa4tune.kernels.fa4_bwd_sm90.kernel import stat_position
    from fa4tune.kernels.fa4_bwd_sm90.preprocess import row_coords, row_lanes

    rows_per_warp = 32 // row_lanes(head_dim)
    total = batch * nheads * padded
    seen = [row_coords(row, nheads, padded) for row in range(total)]
    assert sorted(seen) == [
        (b, h, q) for b in range(batch) for h in range(nheads) for q in range(padded)
    ]
    for first in range(0, total, rows_per_warp):
        sectors = {
            ((b * nheads + h) * padded + stat_position(q)) * 4 // 32
            for b, h, q in seen[first : first + rows_per_warp]
        }
        assert len(sectors) == 1, (first, seen[first : first + rows_per_warp], sectors)


@pytest.mark.parametrize("causal,sq,sk,hq,hkv", [(True, 50, 30, 4, 2), (False, 40, 70, 4, 1)])
def test_the_gradient_reference_is_autograds(causal, sq, sk, hq, hkv):
    """attention_grads_reference's formulas (no autograd: it runs inside ops) against autograd
    through the fp32 forward reference, a gradient of the LSE included."""
    g = torch.Generator().manual_seed(sq)
    q = torch.randn(2, sq, hq, 64, generator=g).to(BF16)
    k, v = (torch.randn(2, sk, hkv, 64, generator=g).to(BF16) for _ in "kv")
    dout = torch.randn(2, sq, hq, 64, generator=g)
    dlse = torch.randn(2, hq, sq, generator=g)
    qf, kf, vf = (t.float().requires_grad_() for t in (q, k, v))
    out, lse = attention_reference(qf, kf, vf, causal=causal, softmax_scale=0.3)
    loss = (out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse).sum()
    auto = torch.autograd.grad(loss, (qf, kf, vf))
    for want, got in zip(auto, attention_grads_reference(q, k, v, dout, causal, 0.3, dlse)):
        assert ((want - got).norm() / want.norm()).item() < 1e-5


# ---- the training job and the benchmark's report, without a GPU --------------------------------
@pytest.mark.parametrize("gpu", ["h200", "h100"])
def test_the_training_job_searches_the_backward_family_on_the_grid(gpu):
    """Each GPU's train job (the H100's a copy of the H200's with its own target, table and DB)."""
    from pathlib import Path

    from fa4tune.tune.job import load_job

    configs = Path(__file__).resolve().parent.parent / "tuning_configs"
    job = load_job(configs / f"{gpu}-bf16-train.yaml")
    assert job.kernel.name == "fa4_bwd_sm90" and len(job.problems) == 15
    assert (
        job.name == f"{gpu}-bf16-train"
        and job.target.name == {"h200": "H200", "h100": "H100-SXM"}[gpu]
    )
    assert [p.key() for p in job.problems] == [
        p.key() for p in load_job(configs / "h200-bf16-train.yaml").problems
    ]
    for p in job.problems:
        config = FAMILY.default_config(p, job.target)
        assert not FAMILY.infeasible_reasons(p, config, job.target), p.key()
    assert FAMILY.work_flops(job.problems[0]) == 2.5 * job.problems[0].flops


def backward_report(monkeypatch):
    """benchmarks/backward.py as a module (its shared helpers on the path, as a script has)."""
    import importlib.util
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    spec = importlib.util.spec_from_file_location("backward_report", benchmarks / "backward.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    return report


def test_the_backward_report_fits_a_ctas_fixed_cost(monkeypatch):
    """The fit of the main kernel's time as blocks x c + CTAs x o on each MHA group's two shortest
    walks: c and o / c of each column, and the longer walk against the fit; GQA rows, lone rows
    and columns without phases left out."""
    report = backward_report(monkeypatch)

    def row(key, ours, fa4):
        cells = {"tuned": {"phases_us": {"main": ours}}, report.FA4: {"phases_us": {"main": fa4}}}
        return {"key": key, "cells": cells}

    rows = []
    for seqlen, batch, slower in ((1024, 16, 1.0), (4096, 4, 1.0), (16384, 1, 1.05)):
        key = f"bf16-d64x64-causal-q{seqlen}-k{seqlen}-b{batch}-h32x32"
        blocks, ctas, group = report.blocks_and_ctas(key)
        assert group == (64, "causal") and ctas == 4096
        assert blocks == batch * 32 * seqlen * (seqlen + 1) / 2 / 128**2
        rows.append(row(key, (0.02 * blocks + 0.05 * ctas) * slower, 0.021 * blocks + 0.03 * ctas))
    rows.append(row("bf16-d128x128-causal-q4096-k4096-b4-h16x4", 900.0, 1000.0))  # GQA: left out
    rows.append(row("bf16-d128x128-full-q1024-k1024-b16-h16x16", 500.0, 480.0))  # alone
    assert report.blocks_and_ctas("bf16-d128x128-causal-q4096-k4096-b4-h16x4") is None
    assert report.blocks_and_ctas("bf16-d64x64-causal-q1000-k2000-b1-h2x2") is None
    text = "\n".join(report.fixed_cost_lines(rows))
    assert "| 64, causal | 20.0 ns, 2.50 | 21.0 ns, 1.43 | q16384: +5.0%, +0.0% |" in text
    assert "128" not in text.split("|---|---|---|---|")[1]
    assert report.fixed_cost_fit([(1.0, 1, 2.0), (2.0, 2, 4.0)]) is None  # one ratio: no fit
    del rows[0]["cells"][report.FA4]["phases_us"]
    assert "| 64, causal | 20.0 ns, 2.50 | - | q16384: +5.0%, - |" in "\n".join(
        report.fixed_cost_lines(rows)
    )


def test_the_backward_report_renders_both_rates_and_the_error_ratio(tmp_path, capsys, monkeypatch):
    import json

    report = backward_report(monkeypatch)

    def cell(bwd, both, error):
        return {"bwd_tflops": bwd, "fwd_bwd_tflops": both, "grad_error": error}

    rows = [
        {
            "key": "k1",
            "tuned_config": "64x128s2",
            "tuned_source": "exact",
            "default_config": "64x128s2",
            "deterministic_config": "64x128s2-det",
            "cells": {
                "tuned": cell(550.0, 600.0, 3e-3),
                "deterministic": cell(275.0, 400.0, 3e-3),
                "default": cell(500.0, 570.0, 3e-3),
                "flash-attn-4": cell(500.0, 560.0, 3e-3),
                "cuDNN": "n/a (SDPA's causal mask is top-left aligned)",
            },
        }
    ]
    header = {"date": "d", "gpu": "NVIDIA H100 80GB HBM3", "target": "H100-SXM", "torch": "2.11",
              "dsl": "4.8.1", "fa4": "b36", "kernel_hash": "0123456789ab", "rounds": 3}  # fmt: skip
    saved = tmp_path / "b.json"
    saved.write_text(json.dumps({"header": header, "rows": rows}))
    assert report.main(["--render", str(saved)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("# Backward report: fa4_bwd_sm90 on the H100-SXM\n")
    assert (
        "| k1 | 64x128s2 (exact) | 64x128s2-det | 64x128s2 | 550 / 600 | 275 / 400 | 500 / 570 | "
        "500 / 560 |" in text
    )
    assert "lowest **1.100x**" in text and "| 1.100 | 1.071 |" in text
    assert "tuned (atomic) backward: geometric mean **0.500x**" in text
    assert "Where the backward's time goes" not in text  # no row measured its phases

    # The phases: each kernel of a profiled call named by PHASES, summed per call, the median
    # over the calls; then the table, with the main kernel's and the rest's ratios.
    ours = [
        ("kernel_cutlass_kernel_BackwardPreprocess_object_at_0", 60.0),
        ("kernel_cutlass_kernel_FlashBackwardSm90_object_at_1", 700.0),
        ("void at::native::vectorized_elementwise_kernel<4, direct_copy_kernel_cuda>", 70.0),
    ]
    slower = [(n, us * 1.1) for n, us in ours] + [("Memset (Device)", 5.0)]
    phases = report.kernel_phases.phase_times([ours, slower, ours], report.PHASES)
    assert phases == {"cast": 70.0, "main": 700.0, "preprocess": 60.0, "zero": 0.0}
    fa4 = [
        ("kernel_cutlass_kernel_FlashAttentionBackwardPreprocess_0", 80.0),
        ("kernel_cutlass_kernel_FlashAttentionBackwardSm90_1", 560.0),
        ("kernel_cutlass_kernel_FlashAttentionBackwardPostprocess_2", 60.0),
        ("void at::native::reduce_kernel<sum>", 10.0),
    ]
    assert report.kernel_phases.phase_of(fa4[3][0], report.PHASES) == "other"
    rows[0]["cells"]["tuned"]["phases_us"] = phases
    rows[0]["cells"]["flash-attn-4"]["phases_us"] = report.kernel_phases.phase_times(
        [fa4], report.PHASES
    )
    saved.write_text(json.dumps({"header": header, "rows": rows}))
    assert report.main(["--render", str(saved)]) == 0
    text = capsys.readouterr().out
    assert "## Where the backward's time goes" in text
    assert "| k1 | 60 | 0 | 700 | 70 | - | 80 | 560 | 60 | 10 | 1.250 | 0.867 |" in text


def test_bad_gradient_inputs_are_named():
    """check_gradient_inputs: dout and out like q with head_dim_v in q's dtype on q's device, lse
    and dlse (batch, heads, seqlen_q) float32 on it."""
    from fa4tune.errors import UnsupportedInput
    from fa4tune.kernels.fa4_bwd_sm90.launch import check_gradient_inputs

    q = torch.zeros(2, 16, 4, 64, dtype=torch.bfloat16)
    k = v = torch.zeros(2, 32, 2, 64, dtype=torch.bfloat16)
    out, lse = torch.zeros_like(q), torch.zeros(2, 4, 16)
    check_gradient_inputs(out, q, k, v, out, lse, lse)
    cases = [
        ((out[:, :8], q, k, v, out, lse), r"dout must be \(2, 16, 4, 64\)"),
        ((out, q, k, v, out.float(), lse), "out must be"),
        ((out, q, k, v, out, lse.double()), r"lse must be \(2, 4, 16\) float32"),
        ((out, q, k, v, out, lse, lse[:1]), "dlse must be"),
        ((out.to("meta"), q, k, v, out, lse), "dout must be on cpu"),
        ((out, q, k, v, out, lse.to("meta")), "lse must be on cpu"),
    ]
    for args, words in cases:
        with pytest.raises(UnsupportedInput, match=words):
            check_gradient_inputs(*args)


def test_a_batch_past_the_grids_z_extent_is_refused_before_any_compile(cpu_backward):
    """The grid's z extent is the batch and CUDA caps it at 65535: a larger batch gets a clear
    UnsupportedInput (and the search skips the problem), not a failed launch."""
    from fa4tune.errors import UnsupportedInput

    q = k = v = out = dout = torch.zeros(65536, 1, 1, 64, dtype=torch.bfloat16)
    lse = torch.zeros(65536, 1, 1)
    with pytest.raises(UnsupportedInput, match=r"batch 65536 > 65535 .*split the batch"):
        cpu_backward(BwdConfig(), False, dout, q, k, v, out, lse)
    big = Problem(batch=65536, head_dim=64)
    assert any("batch 65536" in r for r in FAMILY.unsupported_reasons(big, H200))
    assert not FAMILY.unsupported_reasons(replace(big, batch=65535), H200)


def test_dq_rows_takes_the_dq_warp_and_64_rows_per_warpgroup():
    """dq_rows splits the dQ GEMM by Q rows, 64 a warpgroup; the dQ warp reduces each warpgroup's
    rows."""
    p = Problem(head_dim=64, causal=True)
    rows = BwdConfig(tile_m=128, dq_tma=True, dq_warp=True, ds_stages=2, dq_rows=True)
    assert rows.short() == "128x128s2-tma-w-r-ds2"
    assert not FAMILY.infeasible_reasons(p, rows, H200)
    assert rows.as_deterministic() == replace(rows, deterministic=True)
    assert not FAMILY.infeasible_reasons(p, rows.as_deterministic(), H200)
    assert BwdConfig.from_dict(rows.to_dict()) == rows
    assert BwdConfig.from_dict({"tile_m": 128}).dq_rows is False  # tables written before it
    for config, words in [
        (replace(rows, dq_warp=False), "dq_rows without dq_warp"),
        (replace(rows, tile_m=64), "dq_rows with tile_m=64"),
        (replace(rows, tile_n=64), "tile_m 64"),  # one warpgroup: 64 rows
    ]:
        reasons = FAMILY.infeasible_reasons(p, config, H200)
        assert any(words in r for r in reasons), (config.short(), reasons)


def swap_edge_configs():
    """(config, causal) of every 80-row config the rules admit at head dim 128 (dq_swap)."""
    return [
        (config, causal)
        for config in (
            BwdConfig(tile_m=80, num_stages=st, deterministic=det, dq_tma=tma, dq_warp=w,
                      ds_stages=ds, dq_swap=True)
            for st in (1, 2) for det in (False, True) for tma in (False, True)
            for w in (False, True) for ds in (1, 2)
        )
        for causal in (False, True)
        if not FAMILY.infeasible_reasons(Problem(head_dim=128, causal=causal), config, H200)
    ]  # fmt: skip


def test_80_row_q_blocks_take_the_swapped_dq_gemm_at_head_dim_128():
    """dq_swap (dQ^T = K^T dS^T) puts the Q rows in wgmma's N: 64 or 80 of them, 64 of dQ's
    columns per warpgroup (head dim 128, two warpgroups); 80 rows only so."""
    p = Problem(head_dim=128)
    m80 = BwdConfig(tile_m=80, dq_swap=True, dq_tma=True, dq_warp=True, ds_stages=2)
    assert m80.short() == "80x128s2-tma-w-sw-ds2"
    assert BwdConfig.from_dict(m80.to_dict()) == m80
    assert BwdConfig.from_dict({"tile_m": 64}).dq_swap is False  # tables written before it
    causal = replace(p, causal=True)
    for config in (
        m80,
        replace(m80, tile_m=64),
        BwdConfig(tile_m=80, dq_swap=True),
        replace(m80, deterministic=True),
        replace(m80, num_stages=1, dq_warp=False),
    ):
        assert not FAMILY.infeasible_reasons(p, config, H200), config.short()
        if config != replace(m80, deterministic=True):
            assert not FAMILY.infeasible_reasons(causal, config, H200)
    # ptxas spills the producer warp there (config.KNOWN_SPILLS): the deterministic mode takes the
    # ladder's 64 swapped rows with the dQ warp's turn for the causal problem.
    [spill] = FAMILY.infeasible_reasons(causal, replace(m80, deterministic=True), H200)
    assert "ptxas spills 8 bytes for 80x128s2-det-tma-w-sw-ds2 at head dim 128 causal" in spill
    assert cfg.deterministic_config(m80, causal, H200) == replace(
        m80, tile_m=64, deterministic=True
    )
    # The register model at the swap's edge: 128 + 80 + 20 + 12, no room for early stats; the
    # consumers' deterministic turn does not fit (the dQ warp's does: above).
    assert cfg.consumer_registers_needed(m80, p) == 240
    assert cfg.stats_in_registers(m80, p) == (False, False)
    assert cfg.stats_in_registers(replace(m80, tile_m=64), p) == (True, False)
    assert cfg.deterministic_config(m80, p, H200) == replace(m80, deterministic=True)
    det = cfg.deterministic_config(BwdConfig(tile_m=80, dq_swap=True), p, H200)
    # the ladder's first that fits: the dQ warp's turn at 64 swapped rows
    assert det == replace(m80, tile_m=64, deterministic=True)
    # LSE2 and D stages 128-byte aligned for their TMA copies: 96 values a stage of 80 rows.
    assert cfg.stat_stage_rows(80) == 96 and cfg.stat_stage_rows(64) == 64
    # Q/dO 2 x 40 KB, dS^T 2 x 20, dQ 40, K and V 64, barriers and stats 3: the H200's 227 KB.
    assert sum(cfg.smem_parts(m80, p).values()) == 227 * 1024 == H200.smem_per_block
    for problem, config, words in [
        (p, BwdConfig(tile_m=80), "tile_m=80 without dq_swap"),
        (p, BwdConfig(tile_m=128, dq_swap=True), "dq_swap with tile_m=128"),
        (Problem(head_dim=64), BwdConfig(dq_swap=True), "dq_swap at head_dim=64"),
        (Problem(head_dim=96), BwdConfig(dq_swap=True), "dq_swap at head_dim=96"),
        (Problem(head_dim=256), BwdConfig(dq_swap=True, num_stages=1), "dq_swap at head_dim=256"),
        (p, BwdConfig(tile_n=64, dq_swap=True), "1 consumer warpgroup"),
        (p, replace(m80, tile_m=64, dq_rows=True), "dq_rows with dq_swap"),
        (p, BwdConfig(tile_m=80, dq_swap=True, deterministic=True), "deterministic turn"),
    ]:
        reasons = FAMILY.infeasible_reasons(problem, config, H200)
        assert any(words in r for r in reasons), (config.short(), reasons)
    # 2 stages x 4 dQ paths x 2 dS^T buffers x causal, but the one of KNOWN_SPILLS
    assert len(swap_edge_configs()) == 31
    # The search space offers both; the rules keep them to head dim 128.
    from fa4tune.space.backward import BackwardSpace

    params = BackwardSpace.params(None)
    assert params["tile_m"].choices == (64, 80, 128)
    assert params["dq_swap"].choices == (False, True)


# Measured on the H200 (session 39, TFLOP/s of the backward alone; docs/kernel-notes.md): the
# probe's configs at 4k (and 1k at head dim 128), per (head_dim, seqlen, causal) at 16k tokens.
PROBE = {
    (128, 4096, False): {"64x128s2-tma-ds2": 499.9, "64x128s2-tma-w-ds2": 567.8,
                         "64x128s2-det-ds2": 299.2, "64x128s2-det-tma-w-ds2": 483.0},
    (128, 4096, True): {"64x128s2-tma-ds2": 444.5, "64x128s2-tma-w-ds2": 469.1,
                        "64x128s2-det-ds2": 277.0, "64x128s2-det-tma-w-ds2": 452.8},
    (128, 1024, False): {"64x128s2-tma-ds2": 396.9, "64x128s2-tma-w-ds2": 438.5,
                         "64x128s2-det-ds2": 246.3, "64x128s2-det-tma-w-ds2": 364.6},
    (64, 4096, True): {"64x128s2-tma-ds2": 332.3, "64x128s2-tma-w-ds2": 358.5,
                       "128x128s2-tma-ds2": 371.9, "128x128s2-tma-w-ds2": 404.4,
                       "64x128s2-det-ds2": 213.5, "64x128s2-det-tma-w-ds2": 318.2,
                       "128x128s2-det-tma-w-ds2": 392.4},
    (64, 4096, False): {"64x128s2-tma-ds2": 365.0, "64x128s2-tma-w-ds2": 405.4,
                        "128x128s2-tma-ds2": 426.3, "128x128s2-tma-w-ds2": 461.0,
                        "64x128s2-det-ds2": 226.0, "64x128s2-det-tma-w-ds2": 337.8,
                        "128x128s2-det-tma-w-ds2": 381.9},
}  # fmt: skip
# docs/backward-report.md (session 39): the default of each grid problem, the default of then
# (SESSION39_DEFAULT; the ladder has moved on since, each rung its own measured factor).
SESSION39_DEFAULT = {64: "128x128s2-tma-w-ds2", 128: "64x128s2-tma-w-ds2"}
DEFAULTS = {(64, 1024, False): 346.3, (64, 16384, False): 486.6, (64, 1024, True): 247.8,
            (64, 16384, True): 487.0, (128, 16384, False): 567.1, (128, 1024, True): 305.4,
            (128, 16384, True): 556.0}  # fmt: skip


def _config(short: str) -> BwdConfig:
    tile_m, tile_n = map(int, short.split("s")[0].split("x"))
    return BwdConfig(
        tile_m=tile_m, tile_n=tile_n, deterministic="-det" in short, dq_tma="-tma" in short,
        ds_stages=2 if short.endswith("-ds2") else 1, dq_warp="-w" in short,
    )  # fmt: skip


def _grid_problem(head_dim, seqlen, causal):
    return Problem(head_dim=head_dim, seqlen_q=seqlen, batch=16384 // seqlen,
                   nheads_q=2048 // head_dim, causal=causal)  # fmt: skip


def test_the_cost_model_hides_a_part_of_each_walks_fixed_cost_when_persistent():
    """persistent: the model's fixed cost per wave of walks times PERSISTENT_WAVE (from the H200's
    train search, session 57), the rest of its time the same."""
    from fa4tune.kernels.fa4_bwd_sm90 import cost_model

    model = FAMILY.cost_model(H200)
    problem = _grid_problem(64, 1024, False)
    base = cfg.DEFAULT_LADDER[0]
    (one, _), (walking, _) = (
        model.time_s(c, problem) for c in (base, replace(base, persistent=True))
    )
    waves = math.ceil(problem.batch * problem.nheads_kv * 1024 / 128 / H200.sm_count)
    hidden = waves * cost_model.WAVE_SECONDS * (1 - cost_model.PERSISTENT_WAVE)
    assert one - walking == pytest.approx(hidden) and 0 < hidden < one / 10


def test_the_cost_model_ranks_the_measured_configs_and_is_within_its_stated_error():
    """The model backend's backward times against the H200's (what its docstring states)."""
    import math

    model = FAMILY.cost_model(H200)
    errors = []
    for (d, s, causal), measured in PROBE.items():
        problem = _grid_problem(d, s, causal)
        predicted = {}
        for short, tflops in measured.items():
            config = _config(short)
            assert config.short() == short
            seconds, _ = model.time_s(config, problem)
            predicted[short] = FAMILY.work_flops(problem) / seconds / 1e12
            errors.append(math.log(predicted[short] / tflops))
        # What a search ranks (the deterministic mode is the caller's, not searched): in order.
        searched = [s for s in measured if "-det" not in s]
        assert sorted(searched, key=measured.get) == sorted(searched, key=predicted.get), (d, s)
    for (d, s, causal), tflops in DEFAULTS.items():
        problem = _grid_problem(d, s, causal)
        seconds, _ = model.time_s(_config(SESSION39_DEFAULT[d]), problem)
        errors.append(math.log(FAMILY.work_flops(problem) / seconds / 1e12 / tflops))
    assert math.sqrt(sum(e * e for e in errors) / len(errors)) < 0.06
    assert max(map(abs, errors)) < 0.11


def test_head_dims_192_and_256_go_in_chunks_of_columns_that_fit():
    """Above 128 a CTA computes dK, dV and dQ for one chunk of the head dim (S^T and dP^T over
    all of it): the registers of head dim 96 or 128, the shared memory of the whole head dim."""
    assert [cfg.head_dim_chunk(d) for d in (64, 96, 128, 192, 256)] == [64, 96, 128, 96, 128]
    for d, default in ((192, BwdConfig()), (256, BwdConfig(num_stages=1))):
        for causal in (False, True):
            p = Problem(head_dim=d, causal=causal, seqlen_q=4096, batch=4, nheads_q=8)
            assert default_config(p, H200) == default
            det = cfg.deterministic_config(default, p, H200)
            assert det == replace(default, deterministic=True)
            assert not FAMILY.infeasible_reasons(p, det, H200)
    # Q, dO, K and V whole: at 256, 128 keys and two stages do not fit, nor dQ's staging beside one
    p = Problem(head_dim=256)
    for config, words in [
        (BwdConfig(), "shared memory"),
        (BwdConfig(num_stages=1, dq_tma=True), "shared memory"),
        (BwdConfig(tile_n=64, num_stages=1), "registers"),  # one warpgroup's loop on top
    ]:
        reasons = FAMILY.infeasible_reasons(p, config, H200)
        assert any(words in r for r in reasons), (config.short(), reasons)
    # The chunk's columns, not the head dim's, in the register model: as head dim 128's.
    assert cfg.consumer_registers_needed(BwdConfig(), p) == cfg.consumer_registers_needed(
        BwdConfig(), Problem(head_dim=128)
    )


def test_the_backward_report_takes_a_peers_worst_group_and_keeps_its_nan(monkeypatch):
    """peer_error measures a peer's full dq (the query heads of the K/V head's group), dk and dv
    as the family's check measures fa4tune's, per reference piece, and takes the worst; a NaN
    anywhere wins."""
    import math

    import torch

    from fa4tune.kernels.fa4_bwd_sm90 import FAMILY
    from fa4tune.kernels.fa4_bwd_sm90.measure import BackwardCase

    report = backward_report(monkeypatch)
    problem = Problem(head_dim=64, seqlen_q=8, seqlen_k=8, batch=2, nheads_q=4, nheads_kv=2)
    g = torch.Generator().manual_seed(0)
    dq = torch.randn(2, 8, 4, 64, generator=g)
    dk, dv = (torch.randn(2, 8, 2, 64, generator=g) for _ in "kv")
    case = BackwardCase(problem, *([None] * 6), dq, dk, dv)
    refs = [
        ((b, h), dq[b : b + 1, :, 2 * h : 2 * h + 2], dk[b : b + 1, :, h : h + 1],
         dv[b : b + 1, :, h : h + 1])
        for b in range(2)
        for h in range(2)
    ]  # fmt: skip
    assert report.peer_error(FAMILY, case, (dq, dk, dv), refs) == 0.0
    off = dq.clone()
    off[1, :, 3] *= 1.5  # batch 1, K/V head 1's second query head: half its dq norm off
    worst = report.peer_error(FAMILY, case, (off, dk, dv), refs)
    expected = (0.5 * dq[1, :, 3]).norm() / dq[1, :, 2:4].norm()  # the group's two heads together
    assert worst == pytest.approx(expected.item(), rel=1e-5)
    for b, h in ((0, 0), (1, 1)):  # NaN in the first or the last piece
        bad = dk.clone()
        bad[b, 0, h, 0] = math.nan
        assert math.isnan(report.peer_error(FAMILY, case, (off, bad, dv), refs))
