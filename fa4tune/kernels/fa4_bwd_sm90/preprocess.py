"""The backward's preprocessing kernel: for every query row of (batch, query, head) it reads dO and
O once and writes what the main kernel reads per Q block, into buffers of rows padded to the Q
tile:

    D = softmax_scale x (rowsum(dO * O) - dLSE)   (fp32 products of the 16-bit inputs, summed
                                                   in fp32; the main kernel's dS takes the scale)
    LSE2 = LSE x log2(e)          (+inf where the row saw no key: its P is 0, as exp2(-inf))

and, for the padding rows past seqlen_q, D = 0 and LSE2 = +inf; each row at kernel.stat_position
(the order the main kernel's threads read them in). One warp per row, heads fastest
(as dO and O lie in memory); each lane multiplies head_dim / 32 adjacent columns, a warp reduction
sums them. Memory-bound: dO and O are read once (at 16k tokens x hidden 2048, 134 MB: 32 µs at
4.24 TB/s), against torch's two passes (bf16 products, then their sum) or four (fp32 copies)."""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .kernel import DTYPES, stat_position

WARPS_PER_CTA = 8
LOG2_E = math.log2(math.e)


def _warp_sum(value):
    for offset in (16, 8, 4, 2, 1):
        value = value + cute.arch.shuffle_sync_bfly(value, offset=offset)
    return value


class BackwardPreprocess:
    """Compile-time: the 16-bit dtype, head_dim_v (of dO and O) and whether a dLSE is given.
    Shapes (batch, seqlen_q, heads, padded rows) are run-time."""

    def __init__(self, dtype: str, head_dim_v: int, has_dlse: bool):
        if head_dim_v % 32:
            raise ValueError(
                f"the preprocessing kernel takes head_dim_v a multiple of 32, not {head_dim_v}"
            )
        self.dtype = DTYPES[dtype]
        self.cols_per_lane = head_dim_v // 32
        self.has_dlse = has_dlse

    @cute.jit
    def __call__(
        self,
        mdO: cute.Tensor,  # (batch, seqlen_q, nheads_q, head_dim_v) 16-bit
        mO: cute.Tensor,  # (batch, seqlen_q, nheads_q, head_dim_v) 16-bit
        mLSE: cute.Tensor,  # (batch, nheads_q, seqlen_q) float32, natural log
        mdLSE: cute.Tensor | None,  # (batch, nheads_q, seqlen_q) float32, or None
        mLSE2: cute.Tensor,  # (batch, nheads_q, padded) float32
        mD: cute.Tensor,  # (batch, nheads_q, padded) float32
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        rows = cute.size(mD.shape[0]) * cute.size(mD.shape[1]) * cute.size(mD.shape[2])
        self.kernel(mdO, mO, mLSE, mdLSE, mLSE2, mD, softmax_scale).launch(
            grid=[cute.ceil_div(rows, WARPS_PER_CTA), 1, 1],
            block=[32 * WARPS_PER_CTA, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mdO: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: cute.Tensor | None,
        mLSE2: cute.Tensor,
        mD: cute.Tensor,
        softmax_scale: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % 32
        warp = cute.arch.make_warp_uniform(tidx // 32)
        batch, nheads, padded = mD.shape[0], mD.shape[1], mD.shape[2]
        seqlen_q = mO.shape[1]
        row = bidx * WARPS_PER_CTA + warp
        if row < batch * padded * nheads:
            head = row % nheads
            rest = row // nheads
            query = rest % padded
            b = rest // padded
            at = stat_position(query)  # the order the main kernel reads them in
            if query < seqlen_q:
                col0 = lane * self.cols_per_lane
                acc = Float32(0.0)
                for c in cutlass.range_constexpr(self.cols_per_lane):
                    do = mdO[b, query, head, col0 + c].to(Float32)
                    acc = acc + do * mO[b, query, head, col0 + c].to(Float32)
                acc = _warp_sum(acc)
                if lane == 0:
                    if const_expr(self.has_dlse):
                        acc = acc - mdLSE[b, head, query]
                    mD[b, head, at] = acc * softmax_scale
                    lse = mLSE[b, head, query]
                    lse2 = Float32.inf
                    if lse != -Float32.inf:
                        lse2 = lse * LOG2_E
                    mLSE2[b, head, at] = lse2
            elif lane == 0:
                mD[b, head, at] = Float32(0.0)
                mLSE2[b, head, at] = Float32.inf
