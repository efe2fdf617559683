"""Ragged rows for TMA: one descriptor over a packed tensor of many sequences (varlen Q, K or V, or
the pages of a paged KV cache), through which every sequence is loaded and stored with bounds of
its own, and the warp-wide prefix sum that maps a flat tile number to its sequence.

A TMA descriptor clips rows to the extent of the tensor it was made for, which for a packed batch
is the end of the last sequence: a tile stored across the end of one sequence would write into the
next, and a tile loaded across it reads the next one's rows. The view made here has two modes where
the packed tensor had its rows: the rows (extent 2^30) and an end mode (extent the packed rows + 1)
of the same stride, and a base moved back by 2^30 rows. Rows [start, start + length) of the
packed tensor are then rows [2^30 - length, 2^30) of the view at end coordinate start + length:
row r of the sequence lies at 2^30 - length + r, which is in bounds exactly while r < length. Rows
past the sequence are clipped on a store and read as zeros on a load, whatever lies behind them.
(The same arithmetic as Triton's ragged TMA tensors, with one extra mode.)"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

RAGGED_ROWS = 2**30  # the rows mode of the view: longer than any sequence


def ragged_rows(t: cute.Tensor, rows_mode: int = 0) -> cute.Tensor:
    """The ragged view of `t` for a TMA descriptor (host side): mode `rows_mode` becomes the rows
    mode (extent RAGGED_ROWS) and an end mode of the same stride is appended last, of extent the
    packed rows + 1: an end past the packed tensor (a page id past the cache) is out of bounds, and
    its box reads zeros, not memory past the tensor."""
    rank = cute.rank(t)
    shape, stride = list(t.layout.shape), list(t.layout.stride)
    ends = shape[rows_mode] + 1
    shape[rows_mode] = RAGGED_ROWS
    shape.append(ends)
    stride.append(stride[rows_mode])
    back = tuple(-RAGGED_ROWS if i == rows_mode else 0 for i in range(rank))
    base = cute.domain_offset(back, t).iterator
    return cute.make_tensor(base, cute.make_layout(tuple(shape), stride=tuple(stride)))


def flatten_rows(t: cute.Tensor) -> cute.Tensor:
    """(a, b, heads, d) with mode 0 stepping over whole b's -- pages of a paged cache, or the
    batches of batch-shaped K and V -- as packed rows (a * b, d, heads). The caller checks that
    stride[0] == b * stride[1]."""
    shape, stride = t.layout.shape, t.layout.stride
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            (shape[0] * shape[1], shape[3], shape[2]), stride=(stride[1], stride[3], stride[2])
        ),
    )


def sequence_rows(t: cute.Tensor, start, length, packed: bool = False) -> cute.Tensor:
    """Rows [start, start + length) of a ragged view whose modes other than the rows and the end are
    already picked (a (rows, cols) tensor with the end mode last: t[None, None, head, None] of a
    (rows, cols, heads, ends) view); row 0 of the result is row `start`, and the TMA clips at
    `length`. With `packed` (packed GQA) mode 0 is (group, rows) and the rows are its second
    part."""
    view = t[None, None, start + length]
    first = RAGGED_ROWS - length
    return cute.domain_offset(((0, first) if const_expr(packed) else first, 0), view)


@cute.jit
def warp_prefix_sum(value: Int32, lane: Int32) -> Int32:
    """Inclusive prefix sum of `value` over the lanes of a warp (lane i gets lanes 0..i)."""
    for i in cutlass.range_constexpr(5):
        offset = 1 << i
        other = cute.arch.shuffle_sync_up(value, offset)
        if lane >= offset:
            value = value + other
    return value
