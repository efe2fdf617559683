"""The split-KV combine kernel: the fp32 partials of the splits of every query row into O and LSE.

Split s of a row wrote O_s (normalised by its own row sum) and LSE_s. The row's LSE is
log(sum_s exp(LSE_s)), and O = sum_s exp(LSE_s - LSE) O_s: exactly the unsplit kernel's O and LSE.
A split that saw no key wrote O_s 0 and LSE_s -inf and weighs 0; a row no split saw gives O 0 and
LSE -inf, as the unsplit kernel does.

One warp per row of (batch, query, head): each lane reads a share of the splits' LSE (a warp
reduction gives the max and the sum), then the lanes walk the splits together, each accumulating
head_dim_v / 32 adjacent columns of O, in order from split 0, with the loads of SPLITS_IN_FLIGHT
splits issued at once. The partials are small next to K and V (splits x rows x dv
x 4 bytes, where the splits read blocks x tile_n keys of dv + d elements), so the kernel is
latency-bound and short; nothing here is a knob. It is launched as the split kernel's
programmatic dependent (PDL): the split kernel lets it launch as soon as its last CTAs have started,
and it waits for that grid's end before it reads, which hides its launch behind the split kernel's
tail."""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .kernel import DTYPES

WARPS_PER_CTA = 4
# Splits whose partials a lane loads at once: the loops over the splits are unrolled so that the
# loads of the next splits are issued before this split's math (unrolled once, ptxas issued each
# split's loads only after the last split's FFMAs: an L2 round trip per split). In registers: a
# split's LSE and head_dim_v / 32 columns of O, per split in flight.
SPLITS_IN_FLIGHT = 8
LSE_SPLITS_IN_FLIGHT = 4  # per lane, over splits lane, lane + 32, ...
LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)


def _warp_allreduce(value, op):
    for offset in (16, 8, 4, 2, 1):
        value = op(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
    return value


class SplitCombine:
    """Compile-time: the output dtype and head_dim_v. Shapes (splits, batch, seqlen, heads) are
    run-time."""

    def __init__(self, dtype: str, head_dim_v: int):
        if head_dim_v % 32:
            raise ValueError(
                f"the combine kernel takes head_dim_v a multiple of 32, not {head_dim_v}"
            )
        self.dtype = DTYPES[dtype]
        self.head_dim_v = head_dim_v
        self.cols_per_lane = head_dim_v // 32

    @cute.jit
    def __call__(
        self,
        mOpart: cute.Tensor,  # (splits, batch, seqlen_q, nheads_q, head_dim_v) float32
        mLSEpart: cute.Tensor,  # (splits, batch, nheads_q, seqlen_q) float32
        mO: cute.Tensor,  # (batch, seqlen_q, nheads_q, head_dim_v)
        mLSE: cute.Tensor,  # (batch, nheads_q, seqlen_q) float32
        stream: cuda.CUstream,
    ):
        rows = cute.size(mO.shape[0]) * cute.size(mO.shape[1]) * cute.size(mO.shape[2])
        self.kernel(mOpart, mLSEpart, mO, mLSE).launch(
            grid=[cute.ceil_div(rows, WARPS_PER_CTA), 1, 1],
            block=[32 * WARPS_PER_CTA, 1, 1],
            stream=stream,
            use_pdl=True,
        )

    @cute.kernel
    def kernel(
        self, mOpart: cute.Tensor, mLSEpart: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor
    ):
        # Launched early (programmatic dependent launch): nothing of the split kernel's partials
        # may be read before that grid has ended and its writes are visible.
        cute.arch.griddepcontrol_wait()
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        num_splits = mOpart.shape[0]
        batch, seqlen_q, nheads = mO.shape[0], mO.shape[1], mO.shape[2]
        row = bidx * WARPS_PER_CTA + warp
        if row < batch * seqlen_q * nheads:
            # Heads fastest, as O lies in memory.
            head = row % nheads
            rest = row // nheads
            query = rest % seqlen_q
            b = rest // seqlen_q
            row_max = -Float32.inf
            for s in cutlass.range(lane, num_splits, 32, unroll=LSE_SPLITS_IN_FLIGHT):
                row_max = cute.arch.fmax(row_max, mLSEpart[s, b, head, query])
            row_max = _warp_allreduce(row_max, cute.arch.fmax)
            # Every split empty: subtract 0 so that exp2 gives 0, not NaN.
            shift = row_max if row_max != -Float32.inf else Float32(0.0)
            total = Float32(0.0)
            for s in cutlass.range(lane, num_splits, 32, unroll=LSE_SPLITS_IN_FLIGHT):
                total = total + cute.math.exp2(
                    (mLSEpart[s, b, head, query] - shift) * LOG2_E, fastmath=True
                )
            total = _warp_allreduce(total, lambda a, c: a + c)
            lse = -Float32.inf
            if row_max != -Float32.inf:
                lse = shift + cute.math.log2(total, fastmath=True) * LN2
            acc = cute.make_rmem_tensor(self.cols_per_lane, Float32)
            acc.fill(0.0)
            col0 = lane * self.cols_per_lane
            for s in cutlass.range(num_splits, unroll=SPLITS_IN_FLIGHT):
                weight = Float32(0.0)
                if lse != -Float32.inf:
                    weight = cute.math.exp2(
                        (mLSEpart[s, b, head, query] - lse) * LOG2_E, fastmath=True
                    )
                for c in cutlass.range_constexpr(self.cols_per_lane):
                    acc[c] = acc[c] + weight * mOpart[s, b, query, head, col0 + c]
            for c in cutlass.range_constexpr(self.cols_per_lane):
                mO[b, query, head, col0 + c] = acc[c].to(self.dtype)
            if lane == 0:
                mLSE[b, head, query] = lse
