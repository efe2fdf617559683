"""Small Hopper building blocks for the forward kernel: shared-memory layouts, register-fragment views of
the wgmma accumulator, and one wgmma issue routine."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as hopper
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum


def smem_tile_layout(dtype, rows: int, cols: int, stages: int | None = None):
    """Swizzled layout of a (rows, cols[, stages]) tile whose cols are contiguous in memory.

    wgmma reads it as a K-major operand (Q, K) and, with its first two modes swapped, as an MN-major
    one (V as the B operand of O += P V). TMA writes it as is."""
    atom = warpgroup.make_smem_layout_atom(
        hopper.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def swap_first_modes(t: cute.Tensor) -> cute.Tensor:
    """The same shared memory seen with its first two modes exchanged: (n, d, s) -> (d, n, s)."""
    modes = [1, 0] + list(range(2, cute.rank(t)))
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def permute_modes(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def acc_rows_cols(acc: cute.Tensor) -> cute.Tensor:
    """View a wgmma accumulator fragment ((2, 2, V), M, N) as (rows, cols) = ((2, M), (2, V, N)).

    In the fragment, mode 0 is a pair of adjacent columns, mode 1 the rows r and r+8, mode 2 the
    8-column groups; the view puts every value of one row in one row of the result."""
    s, d = acc.layout.shape, acc.layout.stride
    shape = ((s[0][1], s[1]), (s[0][0], s[0][2], s[2]))
    stride = ((d[0][1], d[1]), (d[0][0], d[0][2], d[2]))
    return cute.make_tensor(acc.iterator, cute.make_layout(shape, stride=stride))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View an fp32 S accumulator ((2, 2, V), M, N) in the order of a 16-bit wgmma A fragment
    ((2, 2, 2), M, (V/2, N)): one k-block of 16 columns is two consecutive 8-column groups, so P can be
    fed to the P·V wgmma from registers without any data exchange between threads."""
    s, d = acc.layout.shape, acc.layout.stride
    assert s[0][2] % 2 == 0, "tile_n must be a multiple of 16"
    shape = ((s[0][0], s[0][1], 2), s[1], (s[0][2] // 2, s[2]))
    stride = ((d[0][0], d[0][1], d[0][2]), d[1], (d[0][2] * 2, d[2]))
    return cute.make_tensor(acc.iterator, cute.make_layout(shape, stride=stride))


def wgmma(tiled_mma, acc, frag_a, frag_b, accumulate: bool, wait: int) -> None:
    """Issue acc (+)= A·B over every k-block as one wgmma group; wait until at most `wait` groups are
    in flight (-1: do not wait)."""
    warpgroup.fence()
    # A fresh atom per call: the ACCUMULATE field is mutated below.
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    for k in range(cute.size(frag_a.shape[2])):  # unrolled at trace time
        cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    if wait >= 0:
        warpgroup.wait_group(wait)
