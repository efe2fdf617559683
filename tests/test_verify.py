"""The correctness gate's slices of the fp32 reference (on the CPU): each slice equals the same rows
of the whole problem's reference, causal offsets included, and the comparison catches NaN, -inf
mismatches and errors above tolerance."""

import math

import pytest
import torch

from fa4tune.kernels.common.reference import attention_reference
from fa4tune.kernels.common.verify import TOLERANCES, compare, reference_slices, row_slices

SHAPES = [
    # (seqlen_q, seqlen_k, batch, nheads_q, nheads_kv)
    (40, 40, 2, 4, 2),
    (70, 25, 1, 2, 1),  # causal rows at the top see no key
    (25, 70, 3, 3, 3),
    (9, 9, 1, 1, 1),
]


def inputs(shape, seed=0):
    sq, sk, b, hq, hkv = shape
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, hq, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(b, sk, hkv, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(b, sk, hkv, 64, generator=g).to(torch.bfloat16)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_slices_equal_the_whole_reference(shape, causal):
    q, k, v = inputs(shape)
    full_o, full_lse = attention_reference(q, k, v, causal=causal)
    slices = reference_slices(q, k, v, causal, None, rows=16)
    assert slices
    for (b, h, start, end), ref_o, ref_lse in slices:
        torch.testing.assert_close(
            ref_o, full_o[b : b + 1, start:end, h : h + 1], rtol=1e-5, atol=1e-6
        )
        torch.testing.assert_close(
            ref_lse, full_lse[b : b + 1, h : h + 1, start:end], rtol=1e-5, atol=1e-6
        )
    # The reference itself as the "kernel output" passes with zero error.
    check = compare(full_o.to(torch.bfloat16), full_lse, slices)
    assert (
        check.verdict(TOLERANCES["bf16"]) is None
        and check.out_error < 4e-3
        and check.lse_error < 1e-5
    )


def test_row_slices_cover_first_and_last_rows():
    assert row_slices(100, 100, False, rows=16) == [(0, 16, 100), (84, 100, 100)]
    assert row_slices(100, 60, True, rows=16) == [(0, 16, 0), (84, 100, 60)]  # top rows see no key
    assert row_slices(10, 10, True, rows=16) == [(0, 10, 10)]


def test_a_wrong_tile_in_the_middle_is_caught():
    """Finite, wrong values in the middle of batch, heads and rows (a scheduler that computed
    another tile there) pass the NaN check and the slices at the ends: the middle slice catches
    them."""
    q, k, v = inputs((120, 120, 3, 4, 2))
    out, lse = attention_reference(q, k, v, causal=True)
    slices = reference_slices(q, k, v, True, None, rows=16)
    assert compare(out.to(torch.bfloat16), lse, slices).verdict(TOLERANCES["bf16"]) is None
    wrong = out.clone()
    wrong[1, 48:64, 2] = out[
        1, 64:80, 2
    ]  # rows 48..63 of the middle batch and head: another tile's
    assert "output error" in compare(wrong, lse, slices).verdict(TOLERANCES["bf16"])
    assert (1, 2, 57, 65) in [index for index, _, _ in slices]


def test_an_error_in_long_causal_rows_is_not_drowned_by_the_short_ones():
    """O of a row that sees few keys is large (it averages few V rows), so summed over the slices
    the first rows' error would hide the last rows': each slice is judged on its own."""
    q, k, v = inputs((600, 600, 1, 1, 1))
    out, lse = attention_reference(q, k, v, causal=True)
    slices = reference_slices(q, k, v, True, None, rows=16)
    tol = TOLERANCES["bf16"]
    assert compare(out, lse, slices).verdict(tol) is None
    off = out.clone()
    off[0, 584:600] *= 1.05  # the last block of rows 5% off, LSE untouched (a wrong P·V, say)
    first, last = [ref_o.norm().item() ** 2 for index, ref_o, _ in slices if index[2] in (0, 584)]
    assert last / (first + last) < 0.03, (
        "the first rows dominate the norm, as at long causal seqlens"
    )
    check = compare(off, lse, slices)
    assert check.worst == (0, 0, 584, 600) and 0.049 < check.out_error < 0.051
    assert (
        check.verdict(tol)
        == "output error 0.05 above tolerance 0.01 (batch 0, head 0, rows 584-599)"
    )


def test_compare_catches_nan_lse_mismatch_and_large_errors():
    q, k, v = inputs((40, 40, 2, 4, 2))
    out, lse = attention_reference(q, k, v, causal=True)
    slices = reference_slices(q, k, v, True, None, rows=16)
    tol = TOLERANCES["bf16"]

    unwritten = out.clone()
    unwritten[1, 20, 1, 3] = math.nan  # outside every slice: still found
    assert "never written" in compare(unwritten, lse, slices).verdict(tol)

    bad_lse = lse.clone()
    bad_lse[0, 0, 0] = float("-inf")
    assert "LSE is finite" in compare(out, bad_lse, slices).verdict(tol)

    off = out.clone()
    off[0, :16, 0] += 1.0
    assert "output error" in compare(off, lse, slices).verdict(tol)

    shifted = lse.clone()
    shifted[-1, -1, -1] += 0.01
    assert "LSE error" in compare(out, shifted, slices).verdict(tol)


def test_the_check_after_timing_runs_the_kernel_again_on_poisoned_outputs():
    """A kernel whose later launches write nothing (a tile counter left non-zero: every tile looks
    taken) leaves the first run's correct output in place; the check after the timed runs must
    not read it."""
    from fa4tune.kernels.common.measure import AttentionCase
    from fa4tune.kernels.fa4_fwd_sm90 import FAMILY
    from fa4tune.measure.gpu_worker import poisoned_check

    q, k, v = inputs((40, 40, 2, 4, 2))
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    slices = reference_slices(q, k, v, True, None, rows=16)
    out, lse = torch.full_like(ref_out, math.nan), torch.full_like(ref_lse, math.nan)
    launches = []

    def first_launch_only():  # the first launch writes everything, the later ones nothing
        if not launches:
            out.copy_(ref_out), lse.copy_(ref_lse)
        launches.append(1)

    first_launch_only()
    assert compare(out, lse, slices).verdict(TOLERANCES["bf16"]) is None
    for _ in range(5):  # the timed runs
        first_launch_only()
    case = AttentionCase(None, q, k, v, out, lse)
    after = poisoned_check(first_launch_only, FAMILY, case, slices, synchronize=lambda: None)
    assert "never written" in after.verdict(TOLERANCES["bf16"]) and len(launches) == 7

    def every_launch():
        out.copy_(ref_out), lse.copy_(ref_lse)

    assert (
        poisoned_check(every_launch, FAMILY, case, slices, synchronize=lambda: None).verdict(
            TOLERANCES["bf16"]
        )
        is None
    )


def test_l2_flusher_refuses_host_memory():
    from fa4tune.measure.timing import L2Flusher

    with pytest.raises(ValueError, match="needs a CUDA device"):
        L2Flusher("cpu")


def test_the_flush_mode_comes_from_the_environment(monkeypatch):
    """Clean unless FA4TUNE_L2_FLUSH says otherwise; a mode it does not know is bad input, told as
    such (not a traceback)."""
    from fa4tune.errors import is_user_error
    from fa4tune.measure.timing import FLUSH_ENV, L2Flusher, flush_mode

    monkeypatch.delenv(FLUSH_ENV, raising=False)
    assert flush_mode() == "clean"
    monkeypatch.setenv(FLUSH_ENV, "dirty")
    assert flush_mode() == "dirty"
    monkeypatch.setenv(FLUSH_ENV, "clean")
    assert flush_mode() == "clean"
    monkeypatch.setenv(FLUSH_ENV, "warm")
    with pytest.raises(ValueError, match="FA4TUNE_L2_FLUSH='warm': want one of dirty, clean") as e:
        flush_mode()
    assert is_user_error(e.value)
    with pytest.raises(ValueError, match="L2Flusher mode 'hot'"):
        L2Flusher(mode="hot")


@pytest.mark.parametrize("mode", ["dirty", "clean"])
def test_a_dirty_flush_overwrites_the_buffer_and_a_clean_one_only_reads_it(mode):
    """The sweep itself, on a host buffer standing in for the GPU's: "dirty" writes every word,
    "clean" reads every word (their sum) and writes none of them."""
    import torch

    from fa4tune.measure.timing import L2Flusher

    flusher = L2Flusher.__new__(L2Flusher)
    flusher.mode, flusher.buffer = mode, torch.arange(1000, dtype=torch.int32)
    flusher.sink = torch.zeros((), dtype=torch.int64)
    flusher()
    if mode == "dirty":
        assert bool((flusher.buffer == 0x5A5A5A5A).all())
    else:
        assert torch.equal(flusher.buffer, torch.arange(1000, dtype=torch.int32))
        assert int(flusher.sink) == 999 * 1000 // 2
