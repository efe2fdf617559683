"""The backward's preprocessing kernel: for every query row of (batch, query, head) it reads dO and
O once, writes what the main kernel reads per Q block into buffers of rows padded to the Q tile,
and zeroes the row of dQ's fp32 accumulator that the main kernel adds into (every row of it: with
dq_flat the accumulator has rows padded to the Q tile, its memory in another order, all zeroed):

    D = softmax_scale x (rowsum(dO * O) - dLSE)   (fp32 products of the 16-bit inputs, summed
                                                   in fp32; the main kernel's dS takes the scale)
    LSE2 = LSE x log2(e)          (+inf where the row saw no key: its P is 0, as exp2(-inf))
    dQ accumulator row = 0

and, for the padding rows past seqlen_q, D = 0 and LSE2 = +inf; each row at kernel.stat_position
(the order the main kernel's threads read them in). A group of lanes per row, a power of two
(`row_lanes`), the rows in the stats' order, queries fastest (`row_coords`): each lane reads 8
adjacent values of dO and of O as one 16-byte load each (the launch passes strides of multiples
of 8 elements: launch._kernel_ready) and stores 16-byte vectors of zeros; a butterfly over the
group sums the products. Memory-bound: dO and O read once and the accumulator written once (at
16k tokens x hidden 2048 and head dim 64, 134 MB each: 63 µs at 4.24 TB/s), one launch where
torch's memset was a second."""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from .kernel import DTYPES, stat_position

WARPS_PER_CTA = 8
LOG2_E = math.log2(math.e)
VECTOR_BYTES = 16
IN_PER_LANE = VECTOR_BYTES // 2  # 16-bit values of dO (and of O) per load
ACC_PER_VECTOR = VECTOR_BYTES // 4  # fp32 zeros per store


def row_lanes(head_dim_v: int) -> int:
    """Lanes per query row: enough for head_dim_v / 8 loads of 16 bytes each, rounded up to a
    power of two so that a row's lanes are a butterfly's group (head dims 96 and 192 leave a
    quarter of them without a load)."""
    need = -(-head_dim_v // IN_PER_LANE)
    return 1 << (need - 1).bit_length()


def row_coords(row, nheads, padded):
    """(batch, head, query) of the kernel's row number `row`: queries fastest, then heads, as LSE,
    D and LSE2 lie in memory, so the rows of one warp (2 to 4 of them at head dims 64 to 128) are
    consecutive queries of one head and their stats share one 32-byte sector (stat_position keeps
    each aligned 4 rows in one); in dO's order (heads fastest) each row's stats took a sector of
    their own. dO and O rows are whole 16-byte vectors in either order. Plain ints or the
    kernel's Int32 alike."""
    rest = row // padded
    return rest // nheads, rest % nheads, row % padded


def _aligned(tensor: cute.Tensor) -> cute.Tensor:
    """`tensor` (rank 4, last stride 1) with every other stride known to be a multiple of one
    16-byte vector's elements, so that an element offset of a row start keeps the pointer's
    16-byte alignment."""
    per_vector = VECTOR_BYTES * 8 // tensor.element_type.width
    s = tensor.stride
    stride = tuple(cute.assume(s[i], divby=per_vector) for i in range(3)) + (1,)
    return cute.make_tensor(tensor.iterator, cute.make_layout(tensor.shape, stride=stride))


class BackwardPreprocess:
    """Compile-time: the 16-bit dtype, head_dim_v (of dO and O), head_dim (of the dQ
    accumulator) and whether a dLSE is given. Shapes (batch, seqlen_q, heads, padded rows) are
    run-time."""

    def __init__(self, dtype: str, head_dim_v: int, head_dim: int, has_dlse: bool):
        if head_dim_v % IN_PER_LANE or head_dim % ACC_PER_VECTOR:
            raise ValueError(
                f"the preprocessing kernel takes head_dim_v a multiple of {IN_PER_LANE} and "
                f"head_dim a multiple of {ACC_PER_VECTOR}, not {head_dim_v} and {head_dim}"
            )
        self.dtype = DTYPES[dtype]
        self.head_dim_v = head_dim_v
        self.head_dim = head_dim
        self.lanes = row_lanes(head_dim_v)
        if self.lanes > 32:
            raise ValueError(f"head_dim_v {head_dim_v} needs more than a warp's lanes per row")
        self.loads = head_dim_v // IN_PER_LANE  # lanes of a row that load
        self.zero_vectors = head_dim // ACC_PER_VECTOR  # a row's 16-byte stores of zeros
        self.rows_per_cta = WARPS_PER_CTA * 32 // self.lanes
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
        mdQacc: cute.Tensor,  # (batch, seqlen_q or padded, nheads_q, head_dim) float32
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        rows = cute.size(mD.shape[0]) * cute.size(mD.shape[1]) * cute.size(mD.shape[2])
        self.kernel(
            _aligned(mdO), _aligned(mO), mLSE, mdLSE, mLSE2, mD, _aligned(mdQacc), softmax_scale
        ).launch(
            grid=[cute.ceil_div(rows, self.rows_per_cta), 1, 1],
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
        mdQacc: cute.Tensor,
        softmax_scale: Float32,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        lane = tidx % self.lanes  # within the row's group
        batch, nheads, padded = mD.shape[0], mD.shape[1], mD.shape[2]
        seqlen_q = mO.shape[1]
        row = bidx * self.rows_per_cta + tidx // self.lanes
        b, head, query = row_coords(row, nheads, padded)
        # A warp may hold padding rows (past seqlen_q) or rows past the last: every lane takes
        # part in the butterfly below.
        live = row < batch * padded * nheads
        acc = Float32(0.0)
        lse = Float32(0.0)
        dlse = Float32(0.0)
        if live:
            if query < seqlen_q:
                if lane == 0:  # read with dO and O, not a memory latency after them
                    lse = mLSE[b, head, query]
                    if const_expr(self.has_dlse):
                        dlse = mdLSE[b, head, query]
                if const_expr(self.loads == self.lanes):
                    acc = self._products(mdO, mO, b, query, head, lane)
                else:
                    if lane < self.loads:
                        acc = self._products(mdO, mO, b, query, head, lane)
            if query < mdQacc.shape[1]:  # its rows: seqlen_q, or padded (dq_flat's order)
                self._zero(mdQacc, b, query, head, lane)
        for step in cutlass.range_constexpr(self.lanes.bit_length() - 1):
            acc = acc + cute.arch.shuffle_sync_bfly(acc, offset=self.lanes >> (step + 1))
        if live:
            if lane == 0:
                at = stat_position(query)  # the order the main kernel reads them in
                if query < seqlen_q:
                    if const_expr(self.has_dlse):
                        acc = acc - dlse
                    mD[b, head, at] = acc * softmax_scale
                    lse2 = Float32.inf
                    if lse != -Float32.inf:
                        lse2 = lse * LOG2_E
                    mLSE2[b, head, at] = lse2
                else:
                    mD[b, head, at] = Float32(0.0)
                    mLSE2[b, head, at] = Float32.inf

    @cute.jit
    def _products(self, mdO: cute.Tensor, mO: cute.Tensor, b, query, head, lane) -> Float32:
        """The sum of this lane's 8 products dO x O of the row, in fp32."""
        dO = cute.make_rmem_tensor(IN_PER_LANE, self.dtype)
        o = cute.make_rmem_tensor(IN_PER_LANE, self.dtype)
        first = lane * IN_PER_LANE
        cute.autovec_copy(self._vector(mdO, b, query, head, first, IN_PER_LANE), dO)
        cute.autovec_copy(self._vector(mO, b, query, head, first, IN_PER_LANE), o)
        acc = Float32(0.0)
        for c in cutlass.range_constexpr(IN_PER_LANE):
            acc = acc + dO[c].to(Float32) * o[c].to(Float32)
        return acc

    @cute.jit
    def _zero(self, mdQacc: cute.Tensor, b, query, head, lane):
        """This lane's 16-byte vectors of zeros in the row of dQ's accumulator."""
        zeros = cute.make_rmem_tensor(ACC_PER_VECTOR, Float32)
        zeros.fill(0.0)
        for j in cutlass.range_constexpr(-(-self.zero_vectors // self.lanes)):
            vector = j * self.lanes + lane
            target = self._vector(mdQacc, b, query, head, vector * ACC_PER_VECTOR, ACC_PER_VECTOR)
            if const_expr((j + 1) * self.lanes <= self.zero_vectors):
                cute.autovec_copy(zeros, target)
            else:
                if vector < self.zero_vectors:
                    cute.autovec_copy(zeros, target)

    @cute.jit
    def _vector(self, tensor: cute.Tensor, b, query, head, first, size: cutlass.Constexpr[int]):
        """The `size` values of row (b, query, head) from column `first` on, one 16-byte vector
        (the row's start and `first` are multiples of a vector: _aligned)."""
        offset = cute.assume(cute.crd2idx((b, query, head, first), tensor.layout), divby=size)
        pointer = (tensor.iterator + offset).align(VECTOR_BYTES)
        return cute.make_tensor(pointer, cute.make_layout(size))
