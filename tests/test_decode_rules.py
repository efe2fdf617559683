"""The decode knobs' rules on the CPU: packed GQA, split-KV, one consumer warpgroup."""

from __future__ import annotations

from fa4tune.kernels.fa4_fwd_sm90 import FAMILY
from fa4tune.kernels.fa4_fwd_sm90.compile import compile_key
from fa4tune.kernels.fa4_fwd_sm90.config import SPLIT_COUNTS, FwdConfig, grid_reasons
from fa4tune.problem import Problem
from fa4tune.target import get_target

H200 = get_target("H200")
DECODE = FwdConfig(tile_m=64, num_stages=3, rescale_threshold=8.0, lazy_max=True)


def decode(nheads_q=32, nheads_kv=8, **fields):
    return Problem(
        seqlen_q=1, seqlen_k=4096, batch=4, nheads_q=nheads_q, nheads_kv=nheads_kv, **fields
    )


def reasons(config, problem):
    return FAMILY.infeasible_reasons(problem, config, H200)


def test_decode_configs_are_feasible():
    for splits in SPLIT_COUNTS:
        for pack in (False, True):
            config = FwdConfig.from_dict({"pack_gqa": pack, "num_splits": splits}, base=DECODE)
            assert reasons(config, decode()) == [], config.short()


def test_pack_needs_a_group_that_divides_the_tile():
    packed = FwdConfig.from_dict({"pack_gqa": True}, base=DECODE)
    assert any("nothing to pack" in r for r in reasons(packed, decode(nheads_q=8, nheads_kv=8)))
    # 96 query heads per K/V head do not divide 64 rows.
    assert any("must divide tile_m=64" in r for r in reasons(packed, decode(96, 1)))
    assert reasons(packed, decode(64, 1)) == []


def test_split_needs_one_tile_per_cta():
    config = FwdConfig.from_dict({"num_splits": 4, "persistent": True}, base=DECODE)
    assert any("needs persistent=False" in r for r in reasons(config, decode()))


def test_packed_grid_counts_kv_heads():
    problem = Problem(seqlen_q=1, seqlen_k=64, batch=1, nheads_q=70000 * 2, nheads_kv=70000)
    assert grid_reasons(FwdConfig.from_dict({"pack_gqa": False}, base=DECODE), problem)
    # Split kernels launch a 3-D grid even when causal.
    causal = Problem(seqlen_q=1, seqlen_k=64, batch=70000, nheads_q=2, nheads_kv=1, causal=True)
    assert grid_reasons(FwdConfig.from_dict({"num_splits": 2}, base=DECODE), causal)
    assert not grid_reasons(DECODE, causal)


def test_one_warpgroup_has_no_pingpong_and_split_counts_share_a_compile():
    assert (
        DECODE.canonical() == FwdConfig.from_dict({"wg_pingpong": False}, base=DECODE).canonical()
    )
    keys = {
        compile_key(
            FwdConfig.from_dict({"num_splits": s}, base=DECODE), "bf16", 128, 128, False, H200
        )
        for s in SPLIT_COUNTS[1:]
    }
    assert len(keys) == 1
    unsplit = compile_key(DECODE, "bf16", 128, 128, False, H200)
    assert unsplit not in keys
    packed = FwdConfig.from_dict({"pack_gqa": True}, base=DECODE)
    assert compile_key(packed, "bf16", 128, 128, False, H200, 4) != compile_key(
        packed, "bf16", 128, 128, False, H200, 8
    )


def test_short_names_the_decode_knobs():
    config = FwdConfig.from_dict({"pack_gqa": True, "num_splits": 12}, base=DECODE)
    assert config.short().endswith("-pg-sp12")
    assert FwdConfig.from_dict(config.to_dict()) == config
    assert FwdConfig.from_dict({"num_splits": 12.0}).num_splits == 12
