"""Decode shapes on the GPU: packed GQA and split-KV against the fp32 reference, with poisoned
outputs, and a CUDA graph of a split launch replayed on new inputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

from test_kernel_gpu import LSE_TOL, OUT_TOL, check_on, make_inputs  # noqa: E402

from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig  # noqa: E402
from fa4tune.problem import Problem  # noqa: E402

DECODE = dict(tile_m=64, tile_n=128, num_stages=3, rescale_threshold=8.0, lazy_max=True)


def decode_problem(batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, causal) -> Problem:
    """The Problem of a case tuple below (its fields in the tuples' order)."""
    return Problem(
        head_dim=head_dim,
        causal=causal,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        batch=batch,
        nheads_q=nheads_q,
        nheads_kv=nheads_kv,
    )


def capture(call, q, k, v):
    """(graph, out, lse): `call(q, k, v)` run once outside the capture (to compile, prepare and
    warm up), then captured into a CUDA graph."""
    call(q, k, v)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = call(q, k, v)
    return graph, out, lse


def replay_on_fresh_inputs(graph, p, inputs, out, lse) -> None:
    """Copy fresh random inputs into the captured buffers, poison the outputs, replay, and check
    them against the fp32 reference (twice, with two seeds)."""
    from fa4tune.kernels.common.reference import attention_reference

    for seed in (2, 3):
        fresh = make_inputs(p, seed=seed)
        for buffer, value in zip(inputs, fresh):
            buffer.copy_(value)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = attention_reference(*fresh, causal=p.causal)
        err = ((out.float() - ref_out).norm() / ref_out.norm()).item()
        assert err <= OUT_TOL, (seed, err)
        assert (lse - ref_lse).abs().max().item() <= LSE_TOL


CASES = [
    # (knobs over DECODE, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, causal)
    ({"pack_gqa": True}, 2, 1, 1000, 32, 8, 128, False),
    ({"pack_gqa": True}, 2, 4, 777, 32, 8, 128, True),  # seqlen_k not a multiple of the tile
    ({"num_splits": 4}, 2, 1, 1000, 32, 8, 128, False),  # split without packing
    ({"pack_gqa": True, "num_splits": 8}, 3, 1, 4096, 32, 8, 128, False),
    # More splits than K blocks (8): half the splits are empty.
    ({"pack_gqa": True, "num_splits": 16}, 1, 1, 1000, 32, 8, 128, False),
    ({"pack_gqa": True, "num_splits": 6}, 2, 4, 2000, 32, 8, 128, True),  # seqlen_q > 1, causal
    ({"pack_gqa": True, "num_splits": 4}, 2, 1, 3000, 32, 1, 128, False),  # MQA
    ({"pack_gqa": True, "num_splits": 4}, 2, 2, 3000, 32, 1, 64, True),  # MQA, hdim 64
    ({"pack_gqa": True, "num_splits": 3}, 2, 16, 1500, 64, 8, 64, True),  # 128 rows: 2 m blocks
    ({"tile_m": 128, "pack_gqa": True, "num_splits": 2}, 2, 64, 3000, 32, 8, 128, True),
    (
        {"tile_m": 128, "pack_gqa": True, "intra_wg_overlap": False, "num_splits": 4},
        2,
        4,
        3000,
        64,
        8,
        128,
        False,
    ),
    # Causal with seqlen_k < seqlen_q: the top rows see no key (LSE -inf), every split of them
    # is empty.
    ({"pack_gqa": True, "num_splits": 2}, 1, 48, 20, 8, 2, 128, True),
]


@pytest.mark.parametrize("knobs,batch,seqlen_q,seqlen_k,nheads_q,nheads_kv,head_dim,causal", CASES)
def test_decode_matches_reference(
    knobs, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, causal
):
    config = FwdConfig(**{**DECODE, **knobs})
    p = decode_problem(batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, causal)
    out_err, lse_err = check_on(config, p, *make_inputs(p, seed=11))
    assert out_err <= OUT_TOL, out_err
    assert lse_err <= LSE_TOL, lse_err


def test_split_launch_replays_in_a_cuda_graph():
    """A split launch (kernel and combine, partials allocated per call) captured once and replayed
    on new inputs copied into the captured buffers gives the reference's output for each."""
    from fa4tune.kernels.fa4_fwd_sm90.launch import prepare_launch
    from fa4tune.target import get_target

    config = FwdConfig(**{**DECODE, "pack_gqa": True, "num_splits": 8})
    p = Problem(head_dim=128, seqlen_q=1, seqlen_k=3000, batch=4, nheads_q=32, nheads_kv=8)
    q, k, v = make_inputs(p, seed=1)
    launch = prepare_launch(p, config, get_target("H200"), q, k, v, None)
    graph, out, lse = capture(launch, q, k, v)
    replay_on_fresh_inputs(graph, p, (q, k, v), out, lse)


DISPATCH_CASES = [
    # (batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, causal)
    (1, 1, 32768, 32, 8, 128, False),  # the default splits 16 ways
    (8, 1, 4096, 32, 8, 128, False),
    (1, 4, 5000, 32, 8, 128, True),  # a draft of four tokens
    (2, 1, 3000, 32, 1, 64, False),  # MQA
    (3, 1, 2000, 32, 32, 128, False),  # MHA: nothing to pack
    (1, 64, 3000, 16, 8, 128, True),  # 128 packed rows: two consumer warpgroups
]


@pytest.mark.parametrize(
    "batch,seqlen_q,seqlen_k,nheads_q,nheads_kv,head_dim,causal",
    DISPATCH_CASES,
    ids=lambda x: str(x),
)
def test_attention_takes_a_decode_config_and_matches_the_reference(
    batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, causal
):
    """fa4tune.attention's lookup gives decode shapes a decode config (the shipped decode table's
    or the decode default): right against the reference with poisoned outputs, and the prepared
    launch (the split path: kernel, then the combine as its programmatic dependent) gives the same
    bits as the converting launch."""
    import fa4tune
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward
    from fa4tune.runtime import dispatch

    p = decode_problem(batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, causal)
    q, k, v = make_inputs(p, seed=5)
    config = dispatch.explain(q, k, v, causal=causal).config
    assert config.tile_m <= 128 and not config.persistent, config.short()
    out_err, lse_err = check_on(config, p, q, k, v)
    assert out_err <= OUT_TOL, out_err
    assert lse_err <= LSE_TOL, lse_err
    out, lse = fa4tune.attention(q, k, v, causal=causal)
    want_out, want_lse = attention_forward(q, k, v, config, causal=causal)
    torch.cuda.synchronize()
    assert torch.equal(out, want_out) and torch.equal(lse, want_lse)


def test_attention_decode_replays_in_a_cuda_graph():
    """fa4tune.attention on a split decode shape, captured once, replayed on new inputs."""
    import fa4tune
    from fa4tune.runtime import dispatch

    p = Problem(head_dim=128, seqlen_q=1, seqlen_k=20000, batch=2, nheads_q=32, nheads_kv=8)
    q, k, v = make_inputs(p, seed=1)
    assert dispatch.explain(q, k, v).config.num_splits > 1
    graph, out, lse = capture(fa4tune.attention, q, k, v)
    replay_on_fresh_inputs(graph, p, (q, k, v), out, lse)


# ---- the in-kernel combine (combine_in_kernel): the last split CTA of a tile merges the partials
# The split cases above with the knob on, plus the default config's split at batch 1 and two
# consumer warpgroups: (knobs over DECODE, then the case fields as in CASES).
THREE_WARPGROUPS = dict(
    tile_m=192, tile_n=64, num_stages=2, pack_gqa=True, num_splits=3, intra_wg_overlap=False
)
COMBINE_CASES = [case for case in CASES if case[0].get("num_splits", 1) > 1] + [
    ({"pack_gqa": True, "num_splits": 16}, 1, 1, 32768, 32, 8, 128, False),
    ({"pack_gqa": True, "num_splits": 128}, 1, 1, 4000, 32, 8, 128, False),  # > 32 splits a lane
    ({"tile_m": 128, "pack_gqa": True, "num_splits": 3}, 2, 16, 777, 64, 8, 64, True),
    # The split loops' unrolls and their remainders: the combine kernel's 8 + 4, the merge's 4 x 3
    # (one and two consumer warpgroups), and the merge one split at a time
    # (resources.merge_splits_in_flight: three warpgroups, head dim 256).
    ({"pack_gqa": True, "num_splits": 12}, 2, 1, 5000, 32, 8, 128, False),
    ({"tile_m": 128, "pack_gqa": True, "num_splits": 12}, 1, 16, 5000, 64, 8, 64, True),
    (THREE_WARPGROUPS, 1, 1, 3000, 32, 8, 128, False),
    # The combine kernel's groups of splits copied in at once (combine.splits_in_flight): two
    # groups of 64 at hd64, of 32 with 4-byte copies at hd96, of 16 with 8-byte copies at hd192.
    ({"pack_gqa": True, "num_splits": 128}, 1, 1, 20000, 32, 8, 64, False),
    ({"pack_gqa": True, "num_splits": 48}, 1, 1, 9000, 16, 4, 96, False),
    ({"tile_n": 64, "pack_gqa": True, "num_splits": 24}, 1, 1, 5000, 16, 2, 192, False),
    (
        {"tile_m": 64, "tile_n": 64, "num_stages": 2, "pack_gqa": True, "num_splits": 3},
        2,
        1,
        3000,
        16,
        2,
        256,
        False,
    ),  # fmt: skip
]


@pytest.mark.parametrize(
    "knobs,batch,seqlen_q,seqlen_k,nheads_q,nheads_kv,head_dim,causal", COMBINE_CASES
)
def test_in_kernel_combine_matches_reference_and_the_combine_kernel(
    knobs, batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, causal
):
    """Against the fp32 reference with poisoned outputs (more splits than K blocks, seqlen_k off
    the tile, MQA, causal seqlen_q > 1, empty splits, rows without keys); and O and LSE bit for bit
    the combine kernel's on the same inputs: the last CTA sums in the combine kernel's order
    (kernel.combine_last). Three launches in a row on one stream give the same bits, and leave the
    stream's split counts at zero."""
    from fa4tune.kernels.common.streams import current_split_counts
    from fa4tune.kernels.fa4_fwd_sm90.config import tile_count
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward

    separate = FwdConfig(**{**DECODE, **knobs})
    config = FwdConfig(**{**DECODE, **knobs, "combine_in_kernel": True})
    p = decode_problem(batch, seqlen_q, seqlen_k, nheads_q, nheads_kv, head_dim, causal)
    q, k, v = make_inputs(p, seed=11)
    out_err, lse_err = check_on(config, p, q, k, v)
    assert out_err <= OUT_TOL, out_err
    assert lse_err <= LSE_TOL, lse_err
    want_out, want_lse = attention_forward(q, k, v, separate, causal=causal)
    runs = [attention_forward(q, k, v, config, causal=causal) for _ in range(3)]
    torch.cuda.synchronize()
    for out, lse in runs:
        assert torch.equal(out, want_out), (out.float() - want_out.float()).abs().max().item()
        assert torch.equal(lse, want_lse)
    tiles = tile_count(config, p)
    counts = current_split_counts(q.device, tiles)
    assert int(counts[:tiles].abs().sum()) == 0, "a tile's split count was not put back to zero"


def test_in_kernel_combine_replays_in_a_cuda_graph():
    """A prepared in-kernel-combine launch (one kernel, no combine) captured once and replayed on
    new inputs twice: right each time, so the graph's split counts were put back to zero by the
    replay before; and an eager launch on the same stream after the replays is right too (the
    graph has its own counts)."""
    from fa4tune.kernels.fa4_fwd_sm90.launch import prepare_launch
    from fa4tune.target import get_target

    config = FwdConfig(**{**DECODE, "pack_gqa": True, "num_splits": 8, "combine_in_kernel": True})
    p = Problem(head_dim=128, seqlen_q=1, seqlen_k=3000, batch=4, nheads_q=32, nheads_kv=8)
    q, k, v = make_inputs(p, seed=1)
    launch = prepare_launch(p, config, get_target("H200"), q, k, v, None)
    assert launch.combine_in_kernel and launch._run_combine is None
    graph, out, lse = capture(launch, q, k, v)
    replay_on_fresh_inputs(graph, p, (q, k, v), out, lse)
    replay_on_fresh_inputs(graph, p, (q, k, v), out, lse)
    eager_out, eager_lse = launch(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(eager_out, out) and torch.equal(eager_lse, lse)


def test_in_kernel_combine_through_attention_takes_one_launch():
    """fa4tune.attention with an in-kernel-combine config in the lookup: one kernel per call
    (torch.profiler sees no combine kernel), the reference's output."""
    import fa4tune
    from fa4tune.kernels.common.reference import attention_reference
    from fa4tune.runtime import dispatch

    p = Problem(head_dim=128, seqlen_q=1, seqlen_k=20000, batch=1, nheads_q=32, nheads_kv=8)
    q, k, v = make_inputs(p, seed=4)
    config = FwdConfig(**{**DECODE, "pack_gqa": True, "num_splits": 16, "combine_in_kernel": True})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "_LAUNCHES", dispatch.PreparedLaunches())
        mp.setattr(dispatch, "lookup", lambda *a, **kw: SimpleNamespace(config=config))
        fa4tune.attention(q, k, v)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out, lse = fa4tune.attention(q, k, v)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert not any("combine" in name.lower() for name in kernels), kernels
    ref_out, ref_lse = attention_reference(q, k, v)
    assert ((out.float() - ref_out).norm() / ref_out.norm()).item() <= OUT_TOL
    assert (lse - ref_lse).abs().max().item() <= LSE_TOL
