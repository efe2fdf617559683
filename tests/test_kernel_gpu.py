"""The Hopper forward kernel against the fp32 reference, on the GPU (skipped without one)."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

from conftest import poisoned_attention  # noqa: E402

from fa4tune.kernels.fa4_fwd_sm90.config import KNOBS, SPLIT_COUNTS, FwdConfig  # noqa: E402
from fa4tune.problem import Problem  # noqa: E402

OUT_TOL = 1e-2  # relative Frobenius error of O for bf16/fp16 inputs
LSE_TOL = 1e-3  # absolute error of the natural-log LSE


def make_inputs(p: Problem, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dtype = torch.bfloat16 if p.dtype == "bf16" else torch.float16

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)

    q = rnd(p.batch, p.seqlen_q, p.nheads_q, p.head_dim)
    k = rnd(p.batch, p.seqlen_k, p.nheads_kv, p.head_dim)
    v = rnd(p.batch, p.seqlen_k, p.nheads_kv, p.head_dim_v)
    return q, k, v


def run_checked(config: FwdConfig, p: Problem, seed: int = 0):
    """Run on fresh random inputs with poisoned outputs; return (O error, LSE error)."""
    return check_on(config, p, *make_inputs(p, seed))


def check_on(config: FwdConfig, p: Problem, q, k, v):
    """Run on q, k, v with poisoned outputs; return (O error, LSE error) against the fp32
    reference."""
    from fa4tune.kernels.common.reference import attention_reference
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward

    out = torch.full(
        (p.batch, p.seqlen_q, p.nheads_q, p.head_dim_v), float("nan"), dtype=q.dtype, device="cuda"
    )
    lse = torch.full(
        (p.batch, p.nheads_q, p.seqlen_q), float("nan"), dtype=torch.float32, device="cuda"
    )
    attention_forward(q, k, v, config, causal=p.causal, out=out, lse=lse)
    torch.cuda.synchronize()
    ref_out, ref_lse = attention_reference(q, k, v, causal=p.causal)
    assert not torch.isnan(out).any(), "some outputs were never written (or are NaN)"
    assert not torch.isnan(lse).any(), "some LSE entries were never written (or are NaN)"
    out_err = ((out.float() - ref_out).norm() / ref_out.norm().clamp_min(1e-30)).item()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse)), "rows without keys must have LSE = -inf"
    lse_err = (lse[finite] - ref_lse[finite]).abs().max().item() if finite.any() else 0.0
    return out_err, lse_err


SHAPES = [
    # (seqlen_q, seqlen_k, batch, nheads_q, nheads_kv)
    (1, 1, 2, 4, 4),
    (113, 113, 2, 4, 4),
    (1000, 1000, 1, 4, 2),  # GQA
    (4096, 4096, 1, 2, 2),
    (113, 1000, 2, 4, 1),  # MQA, seqlen_q < seqlen_k
    (1000, 113, 2, 4, 4),  # seqlen_q > seqlen_k: causal rows at the top see no key
]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "q{}k{}b{}h{}x{}".format(*s))
def test_default_config_matches_reference(head_dim, causal, shape):
    from fa4tune.kernels.fa4_fwd_sm90 import FAMILY

    sq, sk, b, hq, hkv = shape
    p = Problem(
        head_dim=head_dim,
        causal=causal,
        seqlen_q=sq,
        seqlen_k=sk,
        batch=b,
        nheads_q=hq,
        nheads_kv=hkv,
    )
    out_err, lse_err = run_checked(FAMILY.default_config(p), p, seed=hash(shape) & 0xFFFF)
    assert out_err <= OUT_TOL, out_err
    assert lse_err <= LSE_TOL, lse_err


# Every value of every knob appears at least once (poly_degree 1 only without emulation: its error
# is above the bf16 half-ulp, and the feasibility check refuses it with emulation on).
KNOB_CONFIGS = [
    (64, FwdConfig(tile_m=192, tile_n=64, num_stages=5)),
    (64, FwdConfig(tile_m=192, tile_n=96, num_stages=4, emu_share=0.125, poly_degree=2)),
    (64, FwdConfig(tile_m=128, tile_n=192, num_stages=3, emu_share=0.5, poly_degree=5)),
    (128, FwdConfig(tile_n=80, num_stages=1, rescale_threshold=2.0)),
    (128, FwdConfig(tile_n=112, num_stages=3, rescale_threshold=4.0, wg_pingpong=False)),
    (128, FwdConfig(tile_n=144, intra_wg_overlap=False, emu_share=0.25, poly_degree=3)),
    (128, FwdConfig(tile_n=160, rescale_threshold=8.0, emu_share=0.375, poly_degree=4)),
    (128, FwdConfig(tile_n=176, intra_wg_overlap=False, wg_pingpong=False, poly_degree=1)),
    (64, FwdConfig(tile_m=192, tile_n=128, rescale_threshold=8.0, intra_wg_overlap=False)),
    (64, FwdConfig(tile_m=192, rescale_threshold=8.0, rescale_branch=False, persistent=True)),
    (128, FwdConfig(rescale_branch=False)),
    (128, FwdConfig(num_stages=1, intra_wg_overlap=False, persistent=True)),
    (64, FwdConfig(tile_m=192, tile_n=96, persistent=True, wg_epilogue=True)),
    (
        128,
        FwdConfig(
            tile_n=144,
            intra_wg_overlap=False,
            rescale_threshold=4.0,
            persistent=True,
            wg_epilogue=True,
        ),
    ),
    # Four consumer warpgroups; at seqlen 777 three of them have no rows in the last m block.
    (64, FwdConfig(tile_m=256, tile_n=64, rescale_threshold=8.0, persistent=True)),
    (64, FwdConfig(tile_m=256, tile_n=96, intra_wg_overlap=False, num_stages=3)),
    (128, FwdConfig(tile_n=96, rescale_threshold=2.0, persistent=True, q_stages=2)),
    (64, FwdConfig(tile_m=192, rescale_threshold=8.0, persistent=True, lazy_max=True)),
    # One consumer warpgroup; packed GQA (2 query heads per K/V head here), single tile and
    # persistent.
    (128, FwdConfig(tile_m=64, num_stages=3, rescale_threshold=8.0, lazy_max=True)),
    (128, FwdConfig(tile_m=64, tile_n=96, intra_wg_overlap=False, pack_gqa=True)),
    (64, FwdConfig(tile_m=128, rescale_threshold=8.0, persistent=True, pack_gqa=True)),
    # Every split count: 1029 keys are 9 blocks of 128 (8 of 112), so from 12 splits on some
    # splits have no key.
    *(
        (
            (64, 128)[i % 2],
            FwdConfig(
                tile_m=(64, 128)[i % 2],
                tile_n=(128, 112)[i % 2],
                num_stages=2,
                intra_wg_overlap=i % 3 != 2,
                rescale_threshold=8.0,
                lazy_max=i % 3 != 1,
                pack_gqa=i % 2 == 0,
                num_splits=splits,
            ),
        )
        for i, splits in enumerate(SPLIT_COUNTS[1:])
    ),
]

# Shapes with more tiles than SMs, so that a persistent CTA walks several tiles (and, causal, tiles
# of different lengths, some of them without any key).
MANY_TILE_SHAPES = [
    (1000, 1000, 8, 8, 2),  # GQA, 8 x 64 tiles of 128 rows
    (777, 1029, 3, 32, 32),  # seqlen_q < seqlen_k, ragged last tiles
    (1029, 300, 4, 16, 4),  # seqlen_q > seqlen_k: causal tiles at the top see no key
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "shape", SHAPES + MANY_TILE_SHAPES, ids=lambda s: "q{}k{}b{}h{}x{}".format(*s)
)
@pytest.mark.parametrize(
    "head_dim,config",
    [
        (128, FwdConfig(rescale_threshold=8.0, persistent=True)),
        (64, FwdConfig(tile_m=192, rescale_threshold=8.0, persistent=True)),
        (128, FwdConfig(rescale_threshold=8.0, persistent=True, wg_epilogue=True)),
        (64, FwdConfig(tile_m=192, rescale_threshold=8.0, persistent=True, wg_epilogue=True)),
        (64, FwdConfig(tile_m=256, tile_n=64, rescale_threshold=8.0, persistent=True)),
        # Two Q buffers: the producer loads the next tile's Q while this tile's S GEMMs read the
        # other.
        (128, FwdConfig(rescale_threshold=8.0, persistent=True, wg_epilogue=True, q_stages=2)),
        (
            128,
            FwdConfig(intra_wg_overlap=False, rescale_threshold=8.0, persistent=True, q_stages=2),
        ),
        (64, FwdConfig(tile_m=192, rescale_threshold=8.0, persistent=True, q_stages=2)),
        (64, FwdConfig(tile_m=256, tile_n=96, intra_wg_overlap=False, persistent=True, q_stages=2)),
        # The row max taken only after a rise (random scores: hardly ever after a tile's first
        # block).
        (128, FwdConfig(rescale_threshold=8.0, persistent=True, lazy_max=True)),
        (64, FwdConfig(tile_m=192, rescale_threshold=8.0, persistent=True, lazy_max=True)),
        (
            64,
            FwdConfig(
                tile_m=256,
                tile_n=96,
                intra_wg_overlap=False,
                rescale_threshold=8.0,
                persistent=True,
                q_stages=2,
                lazy_max=True,
            ),
        ),
    ],
    ids=lambda x: getattr(x, "short", lambda: str(x))(),
)
def test_persistent_matches_reference(head_dim, config, shape, causal):
    sq, sk, b, hq, hkv = shape
    p = Problem(
        dtype="bf16",
        head_dim=head_dim,
        causal=causal,
        seqlen_q=sq,
        seqlen_k=sk,
        batch=b,
        nheads_q=hq,
        nheads_kv=hkv,
    )
    out_err, lse_err = run_checked(config, p, seed=sq + sk + b)
    assert out_err < OUT_TOL and lse_err < LSE_TOL, (out_err, lse_err)


# tile_m 192 with one CTA per tile leaves warpgroups without rows in the last m block (seqlen % 192
# in 1..128), which then only keep the pipeline and the GEMM turns going: with and without
# intra-warpgroup overlap, with and without ping-pong (whose idle loop once hung:
# docs/kernel-notes.md, v7), one CTA per tile and persistent (causal only: persistent non-causal
# kernels have no idle path). (1024: two idle warpgroups; 1060: one. tile_m 256: 1060 leaves three,
# 1024 none.)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "config",
    [
        FwdConfig(tile_m=192, intra_wg_overlap=False, rescale_threshold=8.0),
        FwdConfig(tile_m=192, num_stages=3),
        FwdConfig(tile_m=192, num_stages=3, wg_pingpong=False),
        FwdConfig(tile_m=192, intra_wg_overlap=False, wg_pingpong=False),
        FwdConfig(tile_m=192, persistent=True, rescale_threshold=8.0),
        FwdConfig(tile_m=192, persistent=True, wg_epilogue=True, wg_pingpong=False),
        FwdConfig(tile_m=256, tile_n=64),
        FwdConfig(
            tile_m=256, tile_n=80, intra_wg_overlap=False, wg_pingpong=False, persistent=True
        ),
        FwdConfig(tile_m=192, persistent=True, q_stages=2),
    ],
    ids=lambda c: c.short(),
)
def test_warpgroups_without_rows_keep_the_tile_right(config, causal):
    for seqlen_q, seqlen_k in ((1024, 1024), (1060, 1500)):
        p = Problem(
            head_dim=64,
            causal=causal,
            seqlen_q=seqlen_q,
            seqlen_k=seqlen_k,
            batch=3,
            nheads_q=16,
            nheads_kv=4,
        )
        out_err, lse_err = run_checked(config, p, seed=seqlen_q)
        assert out_err <= OUT_TOL and lse_err <= LSE_TOL, (p.key(), out_err, lse_err)


LAZY_CONFIGS = [
    (64, FwdConfig(tile_m=192, rescale_threshold=8.0, persistent=True, lazy_max=True)),
    (
        64,
        FwdConfig(
            tile_m=256, tile_n=96, intra_wg_overlap=False, rescale_threshold=8.0, lazy_max=True
        ),
    ),
    (128, FwdConfig(rescale_threshold=8.0, persistent=True, wg_epilogue=True, lazy_max=True)),
    (128, FwdConfig(tile_n=80, rescale_threshold=8.0, intra_wg_overlap=False, lazy_max=True)),
    (128, FwdConfig(rescale_threshold=8.0, persistent=True, q_stages=2, lazy_max=True)),
    # Run 11's pick at hdim 128 causal 4k and GQA 8k: three warpgroups, no ping-pong.
    (
        128,
        FwdConfig(
            tile_m=192,
            tile_n=64,
            wg_pingpong=False,
            rescale_threshold=8.0,
            persistent=True,
            lazy_max=True,
        ),
    ),
    # One K/V stage, and the rescale without a branch.
    (64, FwdConfig(num_stages=1, rescale_branch=False, rescale_threshold=8.0, lazy_max=True)),
]


def rising_inputs(p: Problem, rise: float, seed: int, width: int = 1, quiet: bool = False):
    """q, k, v whose even rows' scores jump at two groups of `width` keys: by rise/2 (in log2 units,
    after the softmax scale) over the other keys' at keys seqlen_k/2 on, and by as much again at
    keys 0 on. The kernel walks the K blocks last first, so both jumps come after a tile's first
    block; the odd rows see the groups far below their max. With `quiet` the rows of q are exactly
    +-(1, ..., 1) and the other keys scaled down, so that their scores stay within a small fraction
    of a log2 unit of 0 and every even row's jumps are the given ones (without, they vary by about
    6%)."""
    q, k, v = make_inputs(p, seed)
    scale_log2 = 1.4426950408889634 / p.head_dim**0.5
    sign = torch.ones(p.seqlen_q, device="cuda")
    sign[1::2] = -1.0
    noise = 0.0 if quiet else 0.5
    q = (q.float() * noise + sign[None, :, None, None]).to(q.dtype)  # each row near +-(1, ..., 1)
    base = 6.0  # about the largest of the other scores, in log2 units
    if quiet:
        k = (k.float() * 0.02).to(k.dtype)
        base = 0.0
    for key, jump in ((p.seqlen_k // 2, base + rise / 2), (0, base + rise)):
        k[:, key : key + width] = (
            jump / scale_log2 / p.head_dim
        )  # a score of about `jump` against (1, ..., 1)
    return q, k, v


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("rise", [40.0, 300.0])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "head_dim,config", LAZY_CONFIGS, ids=lambda x: getattr(x, "short", lambda: str(x))()
)
def test_lazy_max_follows_a_rise(head_dim, config, causal, rise, dtype):
    """A rise of 40 takes the max from P (in fp16 a P of 2^20 would be inf had the max stayed); one
    of 300 overflows P (2^150), so the warp recomputes its scores from shared memory. Either way the
    result is the reference's."""
    p = Problem(
        dtype=dtype,
        head_dim=head_dim,
        causal=causal,
        seqlen_q=700,
        seqlen_k=1000,
        batch=2,
        nheads_q=4,
        nheads_kv=2,
    )
    q, k, v = rising_inputs(p, rise, seed=int(rise))
    out_err, lse_err = check_on(config, p, q, k, v)
    assert out_err <= OUT_TOL and lse_err <= LSE_TOL, (out_err, lse_err)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "rise,width", [(124.5, 64), (127.0, 1)], ids=["sum-overflows", "factor-underflows"]
)
@pytest.mark.parametrize(
    "head_dim,config", LAZY_CONFIGS[:2], ids=lambda x: getattr(x, "short", lambda: str(x))()
)
def test_lazy_max_recomputes_rises_too_large_to_rescale(head_dim, config, causal, rise, width):
    """Rises the slow path must not rescale by, each P finite (below 2^128). 124.5 at groups of 64
    keys: a thread holds 13-16 of a group's columns, whose sum overflows (the first fix of review
    findings: that row's max moved and its sum stayed inf). 127 at one key: the factor 2^-127
    flushes to zero (the second: P, sum and O of the row zeroed while its max moved, O NaN in the
    end). Both must recompute and take the exact step."""
    p = Problem(
        head_dim=head_dim,
        causal=causal,
        seqlen_q=700,
        seqlen_k=1000,
        batch=2,
        nheads_q=4,
        nheads_kv=2,
    )
    q, k, v = rising_inputs(p, 2 * rise, seed=3, width=width, quiet=True)
    out_err, lse_err = check_on(config, p, q, k, v)
    assert out_err <= OUT_TOL and lse_err <= LSE_TOL, (out_err, lse_err)


def test_knob_configs_cover_every_value():
    for knob, values in KNOBS.items():
        seen = {getattr(cfg, knob) for _, cfg in KNOB_CONFIGS}
        assert set(values) <= seen, f"{knob}: {sorted(set(values) - seen)} never tested"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "head_dim,config", KNOB_CONFIGS, ids=lambda x: getattr(x, "short", lambda: str(x))()
)
def test_knob_values_match_reference(head_dim, config, causal):
    p = Problem(
        head_dim=head_dim,
        causal=causal,
        seqlen_q=777,
        seqlen_k=1029,
        batch=2,
        nheads_q=4,
        nheads_kv=2,
    )
    out_err, lse_err = run_checked(config, p, seed=7)
    assert out_err <= OUT_TOL, out_err
    assert lse_err <= LSE_TOL, lse_err


@pytest.mark.parametrize("degree", [3, 4, 5])
def test_emulated_exp2_no_worse_than_mufu(degree):
    p = Problem(head_dim=128, causal=True, seqlen_q=1500, seqlen_k=1500, batch=2, nheads_q=4)
    mufu_err, _ = run_checked(FwdConfig(), p, seed=11)
    emu_err, _ = run_checked(FwdConfig(emu_share=0.5, poly_degree=degree), p, seed=11)
    # Beyond rounding: the polynomial's error (< 1e-4) is far below bf16's half-ulp (3.9e-3).
    assert emu_err <= mufu_err * 1.05 + 1e-4, (emu_err, mufu_err)


def test_fp16_inputs():
    p = Problem(
        dtype="fp16", head_dim=128, causal=True, seqlen_q=1000, seqlen_k=1000, batch=2, nheads_q=4
    )
    out_err, lse_err = run_checked(FwdConfig(emu_share=0.25, poly_degree=4), p, seed=3)
    assert out_err <= 5e-3, out_err
    assert lse_err <= LSE_TOL, lse_err


def test_attention_forward_writes_into_the_callers_out_and_lse_and_refuses_bad_ones():
    """out= and lse= are written with their own strides: the right ones receive the result (a
    strided out too), a wrong shape, dtype or a zero stride is refused before the launch."""
    from fa4tune.kernels.common.inputs import UnsupportedInput
    from fa4tune.kernels.common.reference import attention_reference
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward

    p = Problem(head_dim=128, causal=True, seqlen_q=1000, seqlen_k=1000, batch=2, nheads_q=4)
    q, k, v = make_inputs(p, seed=11)
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    out = torch.full((2, 4, 1000, 128), float("nan"), dtype=q.dtype, device="cuda").transpose(1, 2)
    lse = torch.full((2, 4, 1000), float("nan"), device="cuda")
    got_out, got_lse = attention_forward(q, k, v, FwdConfig(), causal=True, out=out, lse=lse)
    assert got_out is out and got_lse is lse
    assert ((out.float() - ref_out).norm() / ref_out.norm()).item() < OUT_TOL
    assert (lse - ref_lse).abs().max().item() < LSE_TOL
    bad = [
        (dict(out=torch.empty(2, 1000, 4, 64, dtype=q.dtype, device="cuda")), "out must be"),
        (dict(out=torch.empty_like(q, dtype=torch.float16)), "out must be"),
        (dict(lse=torch.empty(2, 4, 999, device="cuda")), "lse must be"),
        (
            dict(lse=torch.empty(1, 1, 1000, device="cuda").expand(2, 4, 1000)),
            "without zero strides",
        ),
    ]
    for kwargs, match in bad:
        with pytest.raises(UnsupportedInput, match=match):
            attention_forward(q, k, v, FwdConfig(), causal=True, **kwargs)


def test_a_batch_the_launch_grid_cannot_hold_is_refused_by_name():
    """Head dim 256, non-causal: the default runs one CTA per tile on a (m blocks, heads, batch)
    grid, whose z extent CUDA caps at 65535."""
    import fa4tune
    from fa4tune.kernels.common.inputs import UnsupportedInput

    q = torch.zeros(65536, 8, 1, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(UnsupportedInput, match=r"batch 65536 > 65535 .*split the batch"):
        fa4tune.attention(q, q, q)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim,head_dim_v", [(96, 96), (192, 128), (192, 192), (256, 256)])
def test_other_head_dims_match_reference(head_dim, head_dim_v, causal):
    from fa4tune.kernels.fa4_fwd_sm90 import FAMILY

    p = Problem(
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        causal=causal,
        seqlen_q=777,
        seqlen_k=1029,
        batch=2,
        nheads_q=4,
        nheads_kv=2,
    )
    out_err, lse_err = run_checked(FAMILY.default_config(p), p, seed=5)
    assert out_err <= OUT_TOL, out_err
    assert lse_err <= LSE_TOL, lse_err


def test_tile_counter_is_zero_after_every_launch_and_graphs_get_their_own(monkeypatch):
    """Persistent causal CTAs take tiles from a per-stream counter that each launch must leave at
    zero: back-to-back launches of different tile counts must all be right, and a CUDA graph must
    replay right (its counter is zeroed inside the graph)."""
    from fa4tune.kernels.common import streams
    from fa4tune.kernels.common.reference import attention_reference
    from fa4tune.kernels.fa4_fwd_sm90 import launch as fwd_launch
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward

    config = FwdConfig(rescale_threshold=8.0, persistent=True)
    problems = [
        Problem(head_dim=128, causal=True, seqlen_q=sq, seqlen_k=sk, batch=b, nheads_q=h)
        for sq, sk, b, h in ((1000, 1000, 3, 16), (300, 1029, 2, 4), (2048, 2048, 2, 80))
    ]
    inputs = [make_inputs(p, seed=i) for i, p in enumerate(problems)]
    stream = torch.cuda.current_stream()
    for _ in range(3):
        for p, (q, k, v) in zip(problems, inputs):
            out = torch.full(
                (p.batch, p.seqlen_q, p.nheads_q, p.head_dim_v),
                float("nan"),
                dtype=q.dtype,
                device="cuda",
            )
            attention_forward(q, k, v, config, causal=True, out=out)
            # the launch's: the current stream's, named by torch's id (a KeyError if it took
            # another)
            counter = streams._COUNTERS[(q.device, "torch", stream.stream_id)]
            ref_out, _ = attention_reference(q, k, v, causal=True)
            err = ((out.float() - ref_out).norm() / ref_out.norm()).item()
            assert err < OUT_TOL, (p.key(), err)
            assert counter.item() == 0, f"{p.key()} left the tile counter at {counter.item()}"

    p, (q, k, v) = problems[2], inputs[2]
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        attention_forward(
            q, k, v, config, causal=True
        )  # warm-up (compiled already) on the side stream
    stream.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    out = torch.full(
        (p.batch, p.seqlen_q, p.nheads_q, p.head_dim_v), float("nan"), dtype=q.dtype, device="cuda"
    )
    handed_out = []
    original = fwd_launch.current_tile_counter
    monkeypatch.setattr(
        fwd_launch,
        "current_tile_counter",
        lambda *a: handed_out.append(original(*a)) or handed_out[-1],
    )
    with torch.cuda.graph(graph):
        attention_forward(q, k, v, config, causal=True, out=out)
    [graph_counter] = (
        handed_out  # kept alive here, as the graph's memory pool keeps it for the graph
    )
    eager = list(streams._COUNTERS.values())
    assert all(graph_counter.data_ptr() != c.data_ptr() for c in eager), (
        "the graph shares an eager counter"
    )
    ref_out, _ = attention_reference(q, k, v, causal=True)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = ((out.float() - ref_out).norm() / ref_out.norm()).item()
        assert err < OUT_TOL, err
        assert graph_counter.item() == 0, "a replay left the graph's counter non-zero"
    assert all(c.item() == 0 for c in eager)


def test_kernels_that_ignore_the_counter_get_one_dummy_even_in_a_graph(monkeypatch):
    """Non-causal and one-CTA-per-tile kernels never touch the tile counter: attention_forward and
    fa4tune.attention hand them one fixed dummy per device and never ask for a stream's counter (so
    nothing is allocated per call inside a graph), and a captured graph replays right."""
    import fa4tune
    from fa4tune.kernels.common import streams
    from fa4tune.kernels.common.reference import attention_reference
    from fa4tune.kernels.fa4_fwd_sm90 import launch as fwd_launch
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward, launch_counter
    from fa4tune.runtime import dispatch

    p = Problem(head_dim=64, causal=False, seqlen_q=1000, seqlen_k=1000, batch=2, nheads_q=8)
    q, k, v = make_inputs(p, seed=11)
    counting = FwdConfig(persistent=True)
    for config, causal in ((counting, False), (FwdConfig(persistent=False), True)):
        assert launch_counter(config, causal, q.device) is streams._UNUSED[q.device]
    assert launch_counter(counting, True, q.device) is not streams._UNUSED[q.device]

    attention_forward(q, k, v, counting)  # compile outside the capture
    dispatch.clear()
    eager, _ = poisoned_attention(q, k, v)
    torch.cuda.synchronize()
    # fa4tune.attention's launch holds its counter getter from when it was made, before the patch
    [launch] = dispatch._LAUNCHES.values()
    assert launch._tile_counter is None and launch._unused_counter is streams._UNUSED[q.device]

    def no_counter_here(*args):
        raise AssertionError("a kernel that ignores the tile counter asked for a stream's counter")

    monkeypatch.setattr(streams, "tile_counter", no_counter_here)
    monkeypatch.setattr(fwd_launch, "current_tile_counter", no_counter_here)
    graph = torch.cuda.CUDAGraph()
    out = torch.full_like(q, float("nan"))
    with torch.cuda.graph(graph):  # captures on a stream of its own
        attention_forward(q, k, v, counting, out=out)
        out2, _ = fa4tune.attention(q, k, v)
    ref_out, _ = attention_reference(q, k, v)
    out2.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for result in (eager, out, out2):
        err = ((result.float() - ref_out).norm() / ref_out.norm()).item()
        assert err < OUT_TOL, err


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_on_another_gpu_than_the_current_one():
    """With cuda:0 current and the tensors on cuda:1, both entry points launch on cuda:1 (the host
    function launches on the current device), with cuda:1's tile counter, and match the
    reference."""
    from fa4tune.kernels.common import streams
    from fa4tune.kernels.common.reference import attention_reference
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward

    p = Problem(head_dim=128, causal=True, seqlen_q=1000, seqlen_k=1000, batch=2, nheads_q=8)
    with torch.cuda.device(1):
        q, k, v = make_inputs(p, seed=5)
        ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    torch.cuda.set_device(0)
    config = FwdConfig(persistent=True)
    for run in (
        lambda: attention_forward(q, k, v, config, causal=True),
        lambda: poisoned_attention(q, k, v, causal=True),
    ):
        out, lse = run()
        torch.cuda.synchronize(1)
        assert out.device == q.device and torch.cuda.current_device() == 0
        err = ((out.float() - ref_out).norm() / ref_out.norm()).item()
        assert err < OUT_TOL, err
        finite = torch.isfinite(ref_lse)
        assert (lse[finite] - ref_lse[finite]).abs().max().item() < LSE_TOL
    assert any(key[0] == q.device for key in streams._COUNTERS), (
        "no tile counter of cuda:1 was made"
    )
    assert all(c.item() == 0 for c in streams._COUNTERS.values())


def test_the_launch_paths_name_torch_streams_by_torch_id_and_external_ones_by_the_driver(
    monkeypatch,
):
    """current_tile_counter, the launch paths' lookup: torch's pool streams and the legacy stream
    get a counter each without a driver query; an external stream is named by the driver's unique
    id, as tile_counter names it; a capture gets a new counter on every call. Pins the torch stream
    id layout that the shortcut reads (native ids odd, an external stream's id its handle)."""
    from cuda.bindings import runtime

    from fa4tune.kernels.common import streams

    device = torch.device("cuda", torch.cuda.current_device())
    legacy = torch.cuda.default_stream(device)
    low, high = torch.cuda.Stream(device), torch.cuda.Stream(device, priority=-1)
    err, raw = runtime.cudaStreamCreate()
    assert int(err) == 0
    external = torch.cuda.ExternalStream(int(raw), device=device)
    try:
        for stream in (low, high):
            assert stream.stream_id & 1 and stream.stream_id != stream.cuda_stream
        assert legacy.cuda_stream == 0 and legacy.stream_id == 0
        assert external.stream_id == external.cuda_stream
        counters = {}
        with monkeypatch.context() as patched:
            patched.setattr(
                streams, "_queries", lambda: pytest.fail("a driver query for a torch stream")
            )
            for name, stream in (("legacy", legacy), ("low", low), ("high", high)):
                with torch.cuda.stream(stream):
                    counters[name] = streams.current_tile_counter(device)
                    assert streams.current_tile_counter(device) is counters[name]
        with torch.cuda.stream(external):
            counters["external"] = streams.current_tile_counter(device)
        assert counters["external"] is streams.tile_counter(device, external.cuda_stream)
        assert len({c.data_ptr() for c in counters.values()}) == 4, "two streams share a counter"
        assert all(c.item() == 0 for c in counters.values())

        graph, seen = torch.cuda.CUDAGraph(), []
        with torch.cuda.graph(graph):
            seen += [streams.current_tile_counter(device) for _ in range(2)]
        assert len({c.data_ptr() for c in seen + list(counters.values())}) == 6
    finally:
        torch.cuda.synchronize()
        runtime.cudaStreamDestroy(raw)


def test_fa4tune_attention_takes_the_counter_of_the_stream_it_launches_on(monkeypatch):
    """fa4tune.attention with a persistent causal kernel, on two streams in turn: each launch takes
    its stream's counter (two streams, two counters), the results match the reference, and both
    counters are back at zero."""
    from types import SimpleNamespace

    from fa4tune.kernels.common.reference import attention_reference
    from fa4tune.kernels.fa4_fwd_sm90 import launch as fwd_launch
    from fa4tune.runtime import dispatch

    p = Problem(head_dim=128, causal=True, seqlen_q=2048, seqlen_k=2048, batch=2, nheads_q=16)
    q, k, v = make_inputs(p, seed=17)
    config = FwdConfig(rescale_threshold=8.0, persistent=True)
    assert config.uses_tile_counter(True)
    monkeypatch.setattr(
        dispatch, "lookup", lambda problem, target, kernel=None: SimpleNamespace(config=config)
    )
    ref_out, _ = attention_reference(q, k, v, causal=True)
    taken = []
    original = fwd_launch.current_tile_counter
    monkeypatch.setattr(
        fwd_launch,
        "current_tile_counter",
        lambda device: (
            taken.append((torch.cuda.current_stream().stream_id, original(device))) or taken[-1][1]
        ),
    )
    dispatch.clear()  # launches made from here on bind the recording getter
    streams = [torch.cuda.Stream(), torch.cuda.Stream(priority=-1)]
    for stream in streams * 2:
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out, _ = poisoned_attention(q, k, v, causal=True)
        torch.cuda.current_stream().wait_stream(stream)
        err = ((out.float() - ref_out).norm() / ref_out.norm()).item()
        assert err < OUT_TOL, err
    # (poisoned_attention calls again, on the same stream, when its poison landed elsewhere)
    called_on = [stream_id for stream_id, _ in itertools.groupby(s for s, _ in taken)]
    assert called_on == [s.stream_id for s in streams * 2]
    [launch] = dispatch._LAUNCHES.values()
    assert launch.config == config
    dispatch.clear()  # its launch holds the recording getter
    counters = {}
    for stream_id, counter in taken:
        assert counters.setdefault(stream_id, counter) is counter, "one stream, two counters"
    first, second = (counters[s.stream_id] for s in streams)
    assert first is not second
    assert first.item() == 0 and second.item() == 0


def test_stream_queries_through_libcuda_agree_with_the_bindings():
    """The counter's two driver queries go through ctypes on libcuda; they must give what the
    cuda-python bindings give, capturing or not."""
    from cuda.bindings import driver

    from fa4tune.kernels.common import streams

    queries = streams._queries()
    assert queries.lib is not None, "libcuda was not opened: the slow path would be used"
    side = torch.cuda.Stream()
    for handle in (side.cuda_stream, torch.cuda.current_stream().cuda_stream):
        assert queries.stream_id(handle) == int(driver.cuStreamGetId(driver.CUstream(handle))[1])
        assert not queries.capturing(handle)
    x = torch.zeros(4, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        x.add_(1)
        seen = queries.capturing(side.cuda_stream)
    assert seen
    assert queries.stream_id(side.cuda_stream) != queries.stream_id(
        torch.cuda.current_stream().cuda_stream
    )


_HUNG_IN_THE_SEARCH = [
    # (head_dim, seqlen, batch, heads, config): the three candidates that hung in the v7 H200 search
    (
        64,
        4096,
        4,
        32,
        dict(tile_m=192, tile_n=80, num_stages=3, rescale_threshold=8.0, wg_pingpong=False),
    ),
    (
        128,
        1024,
        16,
        16,
        dict(tile_m=192, tile_n=80, num_stages=4, emu_share=0.375, wg_pingpong=False),
    ),
    (
        128,
        4096,
        4,
        16,
        dict(
            tile_m=192,
            tile_n=64,
            num_stages=3,
            poly_degree=4,
            emu_share=0.25,
            rescale_threshold=2.0,
            wg_pingpong=False,
            rescale_branch=False,
        ),
    ),
]

_LAUNCH_LOOP = """
import sys, torch
sys.path.insert(0, {root!r})
from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward
for d, s, b, h, knobs in {cases!r}:
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    config = FwdConfig(**knobs)
    for _ in range(1000):
        attention_forward(q, k, v, config, causal=True)
    torch.cuda.synchronize()
print("done")
"""


def test_configs_that_hung_in_the_search_finish():
    """1000 launches of each config that hung in the v7 search (idle warpgroups, no ping-pong), in a
    child process so that a hang fails the test after its timeout instead of stalling the suite."""
    import subprocess
    import sys
    from pathlib import Path

    code = _LAUNCH_LOOP.format(
        root=str(Path(__file__).resolve().parents[1]), cases=_HUNG_IN_THE_SEARCH
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a config that hung in the search hung again (1000 launches each, 240 s)")
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-2000:]
