"""The split-KV combine kernel: the fp32 partials of the splits of every query row into O and LSE.

Split s of a row wrote O_s (normalised by its own row sum) and LSE_s. The row's LSE is
log(sum_s exp(LSE_s)), and O = sum_s exp(LSE_s - LSE) O_s: exactly the unsplit kernel's O and LSE.
A split that saw no key wrote O_s 0 and LSE_s -inf and weighs 0; a row no split saw gives O 0 and
LSE -inf, as the unsplit kernel does.

One warp per row of (batch, query, head), one row per CTA. Each lane reads the LSE partials of
splits lane, lane + 32, ... at once (at most MAX_SPLITS, the largest split count: LSE_PER_LANE a
lane) and keeps them in registers: a butterfly gives the row's max, a second its sum, and each
lane writes its splits' weights exp(LSE_s - LSE) to shared memory. Then the lanes walk the splits
together, each adding head_dim_v / 32 adjacent columns of O_s, read as vectors (16 bytes at
head_dim_v 128 and 256), with the loads of splits_in_flight(head_dim_v) splits issued at once.
The order of every sum is fixed (the in-kernel merge, kernel.combine_last, takes the same one and
matches O and LSE bit for bit): per lane over its splits in order, then the butterfly; O over the
splits in order from 0. The partials are small next to K and V (splits x rows x dv x 4 bytes), so
the kernel is bound by the chain of memory round trips a row waits on: one for the LSE, then one
per splits_in_flight splits (at 128 splits and head_dim_v 128: 1 + 4, where the loads of 8
splits at a time and the LSE read once for the max, once for the sum and once per split with O
took 2 + 16). Nothing here is a knob. It is launched as the split kernel's programmatic dependent
(PDL): the split kernel lets it launch as soon as its last CTAs have started, and it waits for
that grid's end before it reads, which hides its launch behind the split kernel's tail."""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync

from .config import SPLIT_COUNTS
from .kernel import DTYPES

MAX_SPLITS = max(SPLIT_COUNTS)
LSE_PER_LANE = -(-MAX_SPLITS // 32)  # LSE partials a lane keeps in registers
# Shared memory that holds the O partials of the splits in flight (a group of splits is copied in
# with cp.async, every copy issued before the first is waited for).
GROUP_BYTES = 16 * 1024
VECTOR_BYTES = 16
LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)


def splits_in_flight(head_dim_v: int) -> int:
    """Splits whose O a row's warp copies in at once: as many rows of head_dim_v fp32 columns as
    GROUP_BYTES hold, a power of two, at most MAX_SPLITS."""
    fit = GROUP_BYTES // (4 * head_dim_v)
    return min(MAX_SPLITS, 1 << (fit.bit_length() - 1))


def lane_vector_bytes(head_dim_v: int) -> int:
    """The alignment of a lane's head_dim_v / 32 adjacent fp32 columns (a row starts at a multiple
    of head_dim_v): their bytes' largest power of two, at most a 16-byte vector."""
    width = head_dim_v // 32 * 4
    return min(VECTOR_BYTES, width & -width)


def _warp_allreduce(value, op):
    for offset in (16, 8, 4, 2, 1):
        value = op(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
    return value


class SplitCombine:
    """Compile-time: the output dtype and head_dim_v. Shapes (splits, batch, seqlen, heads) are
    run-time; splits at most MAX_SPLITS."""

    def __init__(self, dtype: str, head_dim_v: int):
        if head_dim_v % 32:
            raise ValueError(
                f"the combine kernel takes head_dim_v a multiple of 32, not {head_dim_v}"
            )
        self.dtype = DTYPES[dtype]
        self.head_dim_v = head_dim_v
        self.cols_per_lane = head_dim_v // 32
        self.align = lane_vector_bytes(head_dim_v)
        self.in_flight = splits_in_flight(head_dim_v)
        # A lane's columns as cp.async copies of `align` bytes: (values a copy, copies).
        per_copy = self.align // 4
        self.copies = (per_copy, self.cols_per_lane // per_copy)

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
        self.kernel(self._rows_aligned(mOpart), mLSEpart, mO, mLSE).launch(
            grid=[rows, 1, 1], block=[32, 1, 1], stream=stream, use_pdl=True
        )

    def _rows_aligned(self, mOpart: cute.Tensor) -> cute.Tensor:
        """The O partials with their strides known to be multiples of a lane's columns (the
        launch allocates them contiguous, head_dim_v fastest), so that a lane's first column
        keeps its vector's alignment."""
        s = mOpart.stride
        stride = tuple(cute.assume(s[i], divby=self.cols_per_lane) for i in range(4)) + (1,)
        return cute.make_tensor(mOpart.iterator, cute.make_layout(mOpart.shape, stride=stride))

    @cute.kernel
    def kernel(
        self, mOpart: cute.Tensor, mLSEpart: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor
    ):
        smem = cutlass.memory.SmemAllocator()
        sWeight = smem.allocate_tensor(Float32, cute.make_layout(MAX_SPLITS), 16)
        # A group's O partials: column-major (head_dim_v, splits), a lane's columns of a split
        # adjacent.
        sGroup = smem.allocate_tensor(
            Float32, cute.make_layout((self.head_dim_v, self.in_flight)), 16
        )
        # Launched early (programmatic dependent launch): nothing of the split kernel's partials
        # may be read before that grid has ended and its writes are visible.
        cute.arch.griddepcontrol_wait()
        lane, _, _ = cute.arch.thread_idx()
        row, _, _ = cute.arch.block_idx()
        num_splits = mOpart.shape[0]
        seqlen_q, nheads = mO.shape[1], mO.shape[2]
        # Heads fastest, as O lies in memory.
        head = row % nheads
        rest = row // nheads
        query = rest % seqlen_q
        b = rest // seqlen_q
        lse_s = cute.make_rmem_tensor(LSE_PER_LANE, Float32)  # splits lane, lane + 32, ...
        lse_s.fill(-Float32.inf)
        for j in cutlass.range_constexpr(LSE_PER_LANE):
            if lane + 32 * j < num_splits:
                lse_s[j] = mLSEpart[lane + 32 * j, b, head, query]
        row_max = -Float32.inf
        for j in cutlass.range_constexpr(LSE_PER_LANE):
            row_max = cute.arch.fmax(row_max, lse_s[j])
        row_max = _warp_allreduce(row_max, cute.arch.fmax)
        # Every split empty: subtract 0 so that exp2 gives 0, not NaN.
        shift = row_max if row_max != -Float32.inf else Float32(0.0)
        total = Float32(0.0)
        for j in cutlass.range_constexpr(LSE_PER_LANE):
            if lane + 32 * j < num_splits:
                total = total + cute.math.exp2((lse_s[j] - shift) * LOG2_E, fastmath=True)
        total = _warp_allreduce(total, lambda a, c: a + c)
        lse = -Float32.inf
        if row_max != -Float32.inf:
            lse = shift + cute.math.log2(total, fastmath=True) * LN2
        for j in cutlass.range_constexpr(LSE_PER_LANE):
            weight = Float32(0.0)
            if lse != -Float32.inf:
                weight = cute.math.exp2((lse_s[j] - lse) * LOG2_E, fastmath=True)
            sWeight[lane + 32 * j] = weight
        cute.arch.sync_warp()

        acc = cute.make_rmem_tensor(self.cols_per_lane, Float32)
        acc.fill(0.0)
        part = cute.make_rmem_tensor(self.cols_per_lane, Float32)
        # cp.async: 16 bytes may bypass L1 (.cg); narrower copies must go through it (.ca).
        op = (
            cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL)
            if self.align == 16
            else cpasync.CopyG2SOp()
        )
        copy = cute.make_copy_atom(op, Float32, num_bits_per_copy=self.align * 8)
        col0 = lane * self.cols_per_lane
        # The splits in groups of in_flight: every copy of a group issued, then waited for at
        # once, then the FFMAs in the splits' order. (Loads into registers, unrolled over the
        # splits however far, had ptxas keep about 8 in flight: a round trip per 8 splits.) A lane
        # reads back only the columns it copied itself.
        for first in cutlass.range(0, num_splits, self.in_flight, unroll=1):
            for i in cutlass.range_constexpr(self.in_flight):
                if first + i < num_splits:
                    cute.copy(
                        copy,
                        self._lane_columns(mOpart, first + i, b, query, head, col0),
                        self._lane_slot(sGroup, i, col0, self.copies),
                    )
            cute.arch.cp_async_commit_group()
            cute.arch.cp_async_wait_group(0)
            for i in cutlass.range_constexpr(self.in_flight):
                if first + i < num_splits:
                    cute.autovec_copy(self._lane_slot(sGroup, i, col0, self.cols_per_lane), part)
                    weight = sWeight[first + i]
                    for c in cutlass.range_constexpr(self.cols_per_lane):
                        acc[c] = acc[c] + weight * part[c]
        for c in cutlass.range_constexpr(self.cols_per_lane):
            mO[b, query, head, col0 + c] = acc[c].to(self.dtype)
        if lane == 0:
            mLSE[b, head, query] = lse

    @cute.jit
    def _lane_slot(self, sGroup: cute.Tensor, i, col0, shape: cutlass.Constexpr) -> cute.Tensor:
        """A lane's head_dim_v / 32 columns of the group's split i in shared memory, as `shape`
        (contiguous: the columns, or self.copies)."""
        offset = cute.assume(cute.crd2idx((col0, i), sGroup.layout), divby=self.cols_per_lane)
        pointer = (sGroup.iterator + offset).align(self.align)
        return cute.make_tensor(pointer, cute.make_layout(shape))

    @cute.jit
    def _lane_columns(self, mOpart: cute.Tensor, s, b, query, head, col0) -> cute.Tensor:
        """A lane's head_dim_v / 32 adjacent columns of split s's O for the row, aligned
        (lane_vector_bytes), as self.copies: (values a cp.async copy, copies)."""
        offset = cute.assume(
            cute.crd2idx((s, b, query, head, col0), mOpart.layout), divby=self.cols_per_lane
        )
        # The launch passes generic pointers (from_dlpack); cp.async reads a global one.
        pointer = cute.make_ptr(
            Float32,
            (mOpart.iterator + offset).toint(),
            cute.AddressSpace.gmem,
            assumed_align=self.align,
        )
        return cute.make_tensor(pointer, cute.make_layout(self.copies))
