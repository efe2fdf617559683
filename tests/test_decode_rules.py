"""The decode knobs' rules on the CPU: packed GQA, split-KV, one consumer warpgroup."""

from __future__ import annotations

import pytest

from fa4tune.kernels.fa4_fwd_sm90 import FAMILY
from fa4tune.kernels.fa4_fwd_sm90.compile import compile_key
from fa4tune.kernels.fa4_fwd_sm90.config import SPLIT_COUNTS, FwdConfig, grid_reasons
from fa4tune.problem import Problem
from fa4tune.target import get_target

H200 = get_target("H200")
DECODE = FwdConfig(tile_m=64, num_stages=3)  # exact rescaling: decode_rescale_reasons


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


def test_decode_takes_exact_rescaling_and_prefill_the_lazy_one():
    """The lazy rescale (and so the lazy max) raised decode's O error to 1.04-1.17x
    flash-attn-4's on the H200; exact rescaling gave its output bit for bit. The kernel still
    runs it (a GPU test does); the search and the default pass over it."""
    from fa4tune.space import compose

    lazy = FwdConfig.from_dict({"rescale_threshold": 8.0, "lazy_max": True}, base=DECODE)
    speculative = Problem(seqlen_q=64, seqlen_k=4096, batch=4, nheads_q=32, nheads_kv=8)
    prefill = Problem(seqlen_q=65, seqlen_k=4096, batch=4, nheads_q=32, nheads_kv=8)
    for problem in (decode(), speculative):
        assert reasons(lazy, problem) == []  # the kernel takes it
        [why] = FAMILY.avoid_reasons(problem, lazy, H200)
        assert "decode takes rescale_threshold 0" in why
        space = compose(FAMILY, {"tiles": {}, "pipeline": {}, "decode": {}, "softmax": {}})
        assert why in space.check(problem, lazy, H200)
    assert FAMILY.avoid_reasons(prefill, lazy, H200) == []
    default = FAMILY.default_config(decode(), H200)
    assert default.rescale_threshold == 0.0 and not default.lazy_max
    assert reasons(default, decode()) == [] and FAMILY.avoid_reasons(decode(), default, H200) == []


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


# ---- the decode default --------------------------------------------------------------------------
def problem(batch, nheads_q, nheads_kv, seqlen_k, seqlen_q=1, head_dim=128, causal=False):
    return Problem(
        head_dim=head_dim,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        batch=batch,
        nheads_q=nheads_q,
        nheads_kv=nheads_kv,
        causal=causal,
    )


def test_decode_problems_take_the_decode_default_and_prefill_ones_do_not():
    one_token = FAMILY.default_config(problem(1, 32, 8, 32768), H200)
    assert (one_token.tile_m, one_token.pack_gqa, one_token.persistent) == (64, True, False)
    assert one_token.num_splits == 16  # 8 tiles: 16 splits fill 128 of the 132 SMs
    at_65 = FAMILY.default_config(problem(1, 32, 8, 32768, seqlen_q=65), H200)
    assert not at_65.pack_gqa and at_65.num_splits == 1 and at_65.tile_m >= 128


def test_split_rule_fills_the_waves():
    from fa4tune.kernels.fa4_fwd_sm90.config import default_num_splits, tile_count

    packed = FwdConfig.from_dict({"pack_gqa": True}, base=DECODE)
    # Tiles that fill 80% of the SMs are not split: batch 64 x 8 K/V heads = 512 tiles.
    assert default_num_splits(packed, problem(64, 32, 8, 4096), H200) == 1
    assert default_num_splits(packed, problem(14, 32, 8, 4096), H200) == 1  # 112 tiles
    # 64 tiles: 2 splits give 128 CTAs on 132 SMs (one wave, 97% full).
    assert default_num_splits(packed, problem(8, 32, 8, 32768), H200) == 2
    # Unpacked, each query head is a tile: 32 of them, 4 splits.
    assert tile_count(DECODE, problem(1, 32, 8, 32768)) == 32
    assert default_num_splits(DECODE, problem(1, 32, 8, 32768), H200) == 4
    # One tile (MQA, batch 1): 128 splits, each still 8 blocks of 128 keys.
    assert default_num_splits(packed, problem(1, 32, 1, 131072), H200) == 128
    # Few keys: no split gets fewer than 4 blocks (1k keys = 8 blocks: at most 2 splits).
    assert default_num_splits(packed, problem(1, 32, 8, 1024), H200) == 2
    assert default_num_splits(packed, problem(1, 32, 8, 256), H200) == 1


def test_split_rule_is_the_fewest_splits_near_the_fullest_waves():
    """The rule's definition, checked over a spread of tile counts and key lengths."""
    import math

    from fa4tune.kernels.fa4_fwd_sm90.config import (
        MIN_BLOCKS_PER_SPLIT,
        WAVE_SLACK,
        default_num_splits,
        tile_count,
    )

    packed = FwdConfig.from_dict({"pack_gqa": True}, base=DECODE)
    sms = H200.sm_count
    for batch in (1, 2, 3, 5, 7, 9, 13):
        for seqlen_k in (512, 2048, 8192, 65536, 262144):
            p = problem(batch, 32, 8, seqlen_k)
            tiles, blocks = tile_count(packed, p), math.ceil(seqlen_k / 128)
            chosen = default_num_splits(packed, p, H200)
            allowed = [
                s for s in SPLIT_COUNTS if s == 1 or math.ceil(blocks / s) >= MIN_BLOCKS_PER_SPLIT
            ]
            assert chosen in allowed

            def fill(s, tiles=tiles):
                return tiles * s / sms / math.ceil(tiles * s / sms)

            best = max(fill(s) for s in allowed)
            assert fill(chosen) >= WAVE_SLACK * best
            assert all(fill(s) < WAVE_SLACK * best for s in allowed if s < chosen)


def test_decode_defaults_are_feasible_over_the_decode_spread():
    """Every head dim, GQA ratio (one that divides no tile too), seqlen_q up to 64, causal or not:
    the default passes every rule, packs where the group divides its tile, is never persistent."""
    for head_dim in (64, 96, 128, 192, 256):
        for nheads_q, nheads_kv in ((32, 8), (64, 8), (32, 32), (32, 1), (24, 8), (128, 1)):
            for seqlen_q in (1, 4, 16, 64):
                for causal in (False, True):
                    p = problem(2, nheads_q, nheads_kv, 8192, seqlen_q, head_dim, causal)
                    config = FAMILY.default_config(p, H200)
                    assert reasons(config, p) == [], (p.key(), config.short())
                    group = nheads_q // nheads_kv
                    assert config.pack_gqa == (group > 1 and config.tile_m % group == 0)
                    assert not config.persistent


def test_decode_and_prefill_never_lend_configs():
    from fa4tune.problem import DECODE_MAX_SEQLEN_Q

    decode_p = problem(8, 32, 8, 4096, seqlen_q=DECODE_MAX_SEQLEN_Q)
    prefill_p = problem(8, 32, 8, 4096, seqlen_q=DECODE_MAX_SEQLEN_Q + 1)
    assert (decode_p.regime, prefill_p.regime) == ("decode", "prefill")
    assert decode_p.bucket().regime == "decode" and prefill_p.bucket().regime == "prefill"
    assert decode_p.distance(prefill_p) == float("inf")
    assert decode_p.bucket().distance(prefill_p.bucket()) == float("inf")
    assert problem(1, 32, 8, 4096).distance(decode_p) < float("inf")


def test_the_in_kernel_combine_needs_splits_and_batch_shaped_q():
    """combine_in_kernel merges a tile's splits: without splits it is refused rather than ignored,
    so that the search does not measure one kernel under two names; varlen Q is left to the combine
    kernel. Paged K/V (batch-shaped Q) is taken."""
    alone = FwdConfig.from_dict({"pack_gqa": True, "combine_in_kernel": True}, base=DECODE)
    assert any("needs num_splits > 1" in r for r in reasons(alone, decode()))
    for splits in SPLIT_COUNTS[1:]:
        config = FwdConfig.from_dict({"num_splits": splits}, base=alone)
        assert reasons(config, decode()) == [], config.short()
        assert config.short().endswith(f"-sp{splits}-ck")
    split = FwdConfig.from_dict({"num_splits": 4}, base=alone)
    varlen = Problem(seqlen_q=1, seqlen_k=4096, batch=4, nheads_q=32, nheads_kv=8, total_q=4)
    assert any("varlen Q" in r for r in reasons(split, varlen))
    paged = Problem(seqlen_q=1, seqlen_k=4096, batch=4, nheads_q=32, nheads_kv=8, page_size=64)
    assert reasons(split, paged) == []


def test_the_in_kernel_combine_is_a_kernel_of_its_own():
    """Its compile key differs from the separate combine's (one launch, other arguments), every
    count above 1 is still one kernel, and the knob off leaves a config's dict, short name and key
    as they were (the shipped tables carry)."""
    split = FwdConfig.from_dict({"pack_gqa": True, "num_splits": 4}, base=DECODE)
    in_kernel = FwdConfig.from_dict({"combine_in_kernel": True}, base=split)

    def key(config):
        return compile_key(config, "bf16", 128, 128, False, H200, pack_group=4)

    assert key(in_kernel) != key(split)
    assert key(in_kernel) == key(FwdConfig.from_dict({"num_splits": 16}, base=in_kernel))
    assert not split.combine_in_kernel and "-ck" not in split.short()
    assert FwdConfig.from_dict(split.to_dict()) == split


def test_the_decode_space_searches_the_in_kernel_combine():
    from fa4tune.space import compose

    space = compose(FAMILY, {"decode": {}})
    assert "combine_in_kernel" in space.param_names
    problem = decode()
    alone = FwdConfig.from_dict({"pack_gqa": True, "combine_in_kernel": True}, base=DECODE)
    assert any("needs num_splits > 1" in r for r in space.check(problem, alone, H200))


def test_the_decode_report_measures_the_in_kernel_combine_against_the_kernel(monkeypatch):
    """benchmarks/decode.py's `default-ck` column: the default config with combine_in_kernel where
    the default splits (a reason where it does not), and the summary's ratio of the two merges."""
    import importlib.util
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    spec = importlib.util.spec_from_file_location("decode_report", benchmarks / "decode.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    import tuning_report

    made = []
    monkeypatch.setattr(
        tuning_report, "fa4tune_runner", lambda problem, config, *a: made.append(config) or "run"
    )
    long = Problem(seqlen_q=1, seqlen_k=32768, batch=1, nheads_q=32, nheads_kv=8)
    default = FAMILY.default_config(long, H200)
    assert default.split and not default.combine_in_kernel
    assert report.in_kernel_runner(long, default, H200, None, None, None, FAMILY) == "run"
    assert made == [FwdConfig.from_dict({"combine_in_kernel": True}, base=default)]
    wide = Problem(seqlen_q=1, seqlen_k=1024, batch=256, nheads_q=32, nheads_kv=8)
    unsplit = FAMILY.default_config(wide, H200)
    assert not unsplit.split
    assert "does not split" in report.in_kernel_runner(wide, unsplit, H200, *[None] * 3, FAMILY)

    def row(tuned, default, ck):
        cells = {"tuned": {"tbs": tuned}, "default": {"tbs": default}}
        cells["default-ck"] = {"tbs": ck} if ck else "n/a (the default does not split)"
        return {"kv_bytes": 2**30, "cells": cells}

    copy = report.MEASURED_COPY_TBS["H200"]
    lines = report.summary([row(3.0, 2.5, 2.75), row(3.0, 3.0, None), row(3.0, 2.0, 1.8)], copy)
    merge = next(line for line in lines if "merged in the kernel" in line)
    assert "on the 2 shapes where the default splits" in merge
    assert "**0.995x**, lowest 0.900x, highest 1.100x" in merge
    # Headroom over the default: at the copy rate (4.24 TB/s) 4.24/2.5, 4.24/3.0, 4.24/2.0; at the
    # fastest column 3.0/2.5, 1 (none faster), 3.0/2.0.
    assert report.headroom(
        [row(3.0, 2.5, 2.75), row(3.0, 3.0, None), row(3.0, 2.0, 1.8)], copy
    ) == pytest.approx(((4.24**3 / 15.0) ** (1 / 3), (1.2 * 1.5) ** (1 / 3)))
    over = next(line for line in lines if "against the default heuristic" in line)
    assert "the headroom: at most **1.719x** if every shape ran at the copy rate" in over
    assert "1.216x where each took the fastest column" in over
    # Faster than the copy rate: no headroom there, but a peer's faster rate counts.
    fast = {"kv_bytes": 2**30, "cells": {"default": {"tbs": 4.5}, "cuDNN": {"tbs": 4.59}}}
    assert report.headroom([fast], copy) == pytest.approx((1.0, 1.02))
