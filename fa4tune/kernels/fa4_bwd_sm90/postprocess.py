"""The backward's cast of a dq_flat accumulator: dQ's fp32 values, laid out in the order of the
main kernel's wgmma fragments (config.flat_slab, config.flat_dq_offset), read back into dQ (batch,
seqlen_q, heads, head_dim) in q's 16-bit dtype. Without dq_flat the accumulator is dQ's own shape
and torch casts it (launch.py).

A CTA of 128 threads per slab of a (batch, head), the heads of a row block side by side in the
grid (together they write whole rows of dQ). Thread t reads its four values of each 8-column
group of the 64-row accumulator the slab came from (one 16-byte load; a warp's loads are 512
contiguous bytes), casts them and puts them in a shared tile in dQ's row order, a row pitch of the
slab's columns + 8 elements: dQ's accumulator's two pairs as 4-byte stores (a warp's on 32
different banks), dQ^T's (dq_swap: its rows are dQ's columns) one value at a time (2-byte
stores, a warp's four rows 32 bytes apart modulo 128: no conflict either). After the CTA's
barrier each thread reads 8 columns of a row back (16-byte loads) and writes them (16-byte
stores, a warp's cover whole rows of the slab), skipping the rows past seqlen_q. Memory-bound: the
accumulator read once and dQ written once (at 16k tokens x hidden 2048, 134 MB and 67 MB: 47 µs
at 4.24 TB/s), as torch's cast.
"""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64

from . import config as cfg
from .kernel import DTYPES

THREADS = 128  # a warpgroup's: the fragment order's threads


class FlatDqCast:
    """Compile-time: the 16-bit dtype, the head dim and the slab (config.flat_slab: dQ's rows and
    columns of it, and whether it lies transposed, as dQ^T's accumulator). Shapes are
    run-time."""

    def __init__(self, dtype: str, head_dim: int, rows: int, cols: int, transposed: bool = False):
        # the accumulator the slab came from: 64 rows by `width` columns
        width = rows if transposed else cols
        height = cols if transposed else rows
        if height != cfg.FLAT_ROWS or width % 8 or cols % 8 or head_dim % cols:
            raise ValueError(
                f"dq_flat's slabs are a 64-row accumulator of a multiple of 8 columns whose dQ "
                f"columns divide the head dim, not {rows} x {cols} "
                f"{'transposed ' if transposed else ''}of head dim {head_dim}"
            )
        self.dtype = DTYPES[dtype]
        self.head_dim = head_dim
        self.rows, self.cols, self.transposed = rows, cols, transposed
        self.groups = width // 8  # a thread's 16-byte loads
        self.slices = head_dim // cols

    @cute.jit
    def __call__(
        self,
        mAcc: cute.Tensor,  # (batch, rows padded to the Q tile, heads, head_dim) fp32, flat order
        mdQ: cute.Tensor,  # (batch, seqlen_q, heads, head_dim) 16-bit, strides multiples of 8
        stream: cuda.CUstream,
    ):
        blocks = cute.size(mAcc.shape[1]) // self.rows
        tile = cute.make_layout((self.rows, self.cols), stride=(self.cols + 8, 1))

        field = cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(tile)], 16]

        @cute.struct
        class SharedStorage:
            sTile: field

        self.kernel(mAcc, mdQ, tile, SharedStorage).launch(
            grid=[cute.size(mdQ.shape[2]), blocks * self.slices, cute.size(mdQ.shape[0])],
            block=[THREADS, 1, 1],
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        mAcc: cute.Tensor,
        mdQ: cute.Tensor,
        tile: cute.Layout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        head, bx, batch = cute.arch.block_idx()
        rows, cols, groups = self.rows, self.cols, self.groups
        row_block = bx // self.slices
        column_slice = bx % self.slices
        blocks = mAcc.shape[1] // rows
        heads = mdQ.shape[2]
        seqlen_q = mdQ.shape[1]
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sTile = storage.sTile.get_tensor(tile)
        block = (Int64(batch) * heads + head) * blocks + row_block
        base = (block * self.slices + column_slice) * (rows * cols) + tidx * 4
        lane = tidx % 32
        acc_row = tidx // 32 * 16 + lane // 4  # of the accumulator, and acc_row + 8
        acc_col = lane % 4 * 2  # of the thread's pairs, + 8 j
        # every load first (the stores could alias them for all the compiler knows)
        values = cute.make_rmem_tensor((4, groups), Float32)
        for j in cutlass.range_constexpr(groups):
            source = (mAcc.iterator + base + j * 4 * THREADS).align(16)
            cute.autovec_copy(cute.make_tensor(source, cute.make_layout(4)), values[None, j])
        for j in cutlass.range_constexpr(groups):
            for h in cutlass.range_constexpr(2):
                pair = cute.make_rmem_tensor(2, Float32)
                pair[0] = values[2 * h, j]
                pair[1] = values[2 * h + 1, j]
                out = cute.make_rmem_tensor(2, self.dtype)
                out.store(pair.load().to(self.dtype))
                if cutlass.const_expr(self.transposed):
                    # dQ^T's pair: two queries (dQ's rows) of one column
                    for e in cutlass.range_constexpr(2):
                        sTile[acc_col + 8 * j + e, acc_row + 8 * h] = out[e]
                else:
                    spot = cute.crd2idx((acc_row + 8 * h, acc_col + 8 * j), tile)
                    target = (sTile.iterator + spot).align(4)
                    cute.autovec_copy(out, cute.make_tensor(target, cute.make_layout(2)))
        cute.arch.sync_threads()
        # each thread's 8-column pieces of the slab, in row order: a warp's 32 cover whole rows
        per_row = cols // 8
        pieces = rows * per_row
        for n in cutlass.range_constexpr(-(-pieces // THREADS)):
            piece = tidx + n * THREADS
            slab_row = piece // per_row
            group = piece % per_row
            dq_row = row_block * rows + slab_row
            if (pieces % THREADS == 0 or piece < pieces) and dq_row < seqlen_q:
                eight = cute.make_rmem_tensor(8, self.dtype)
                piece_at = (sTile.iterator + cute.crd2idx((slab_row, group * 8), tile)).align(16)
                cute.autovec_copy(cute.make_tensor(piece_at, cute.make_layout(8)), eight)
                place = cute.crd2idx(
                    (batch, dq_row, head, column_slice * cols + group * 8), mdQ.layout
                )
                dq_at = (mdQ.iterator + place).align(16)
                cute.autovec_copy(eight, cute.make_tensor(dq_at, cute.make_layout(8)))
