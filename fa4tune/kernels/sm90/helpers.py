"""Small Hopper building blocks of the forward and backward kernels: shared-memory layouts,
register-fragment views of the wgmma accumulator, one wgmma issue routine, the TMA load
pipelines, and the persistent kernels' fetch from a work counter."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as hopper
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.utils import LayoutEnum


def tma_pipeline(barriers, stages: int, tx_bytes: int, consumer_warps: int):
    """A TMA load pipeline of `stages` stages on the mbarriers at `barriers` (a shared-memory
    pointer to 2 x stages of them): one producer thread issues a stage's loads, which bring
    `tx_bytes` bytes in all, and the stage is released by one arrive of each of `consumer_warps`
    warps. The barriers' initialization is not synchronized here: the kernel fences and syncs
    once after building all its pipelines (cute.arch.mbarrier_init_fence, sync_threads)."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers,
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_warps),
        tx_count=tx_bytes,
        defer_sync=True,
    )


@cute.jit
def fetch_from_counter(counter: cute.Tensor, count: Int32):
    """A producer warp's next unit of work (a tile, a walk) from a launch's global counter, which
    is zero at the launch: the first `grid` units are the block indices, so fetch k returns grid +
    k. A launch makes exactly `count` fetches (one per unit past the grid's first, one more per CTA
    that finds none left), so the fetch that sees count - 1 is the last and puts the counter back
    to zero for the next launch. The whole warp calls it; lane 0 adds."""
    old = Int32(0)
    if cute.arch.lane_idx() == 0:
        old = cute.arch.atomic_add(counter.iterator, Int32(1), sem="relaxed", scope="gpu")
        if old == count - 1:
            counter[0] = Int32(0)
    return cute.arch.shuffle_sync(old, 0) + cute.arch.grid_dim()[0]


def smem_tile_layout(
    dtype, rows: int, cols: int, stages: int | None = None, atom_cols: int | None = None
):
    """Swizzled layout of a (rows, cols[, stages]) tile whose cols are contiguous in memory.

    wgmma reads it as a K-major operand (Q, K) and, with its first two modes swapped, as an MN-major
    one (V as the B operand of O += P V). TMA writes it as is. The swizzle atom is the widest that
    divides `atom_cols` (default cols): an MN-major read of a slice of the columns needs one that
    divides the slice."""
    atom = warpgroup.make_smem_layout_atom(
        hopper.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols or cols), dtype
    )
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def swap_first_modes(t: cute.Tensor) -> cute.Tensor:
    """The same shared memory seen with its first two modes exchanged: (n, d, s) -> (d, n, s)."""
    modes = [1, 0] + list(range(2, cute.rank(t)))
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def stages_as_rows(t: cute.Tensor) -> cute.Tensor:
    """A (rows, cols, stages) tile seen as (rows * stages, cols): stage s holds rows
    [s * rows, (s + 1) * rows)."""
    shape, stride = t.layout.shape, t.layout.stride
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            ((shape[0], shape[2]), shape[1]), stride=((stride[0], stride[2]), stride[1])
        ),
    )


def permute_modes(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def pack_rows(t: cute.Tensor, group: int, head_mode: int) -> cute.Tensor:
    """Packed GQA's view of a seqlen-major tensor (mode 0 the queries, `head_mode` the query heads):
    mode 0 becomes (group, seqlen), the `group` query heads of one K/V head fastest, and the heads
    mode counts K/V heads. Row r of a head is then query r // group of query head
    head * group + r % group."""
    shape, stride = list(t.layout.shape), list(t.layout.stride)
    shape[0], stride[0] = (group, shape[0]), (stride[head_mode], stride[0])
    shape[head_mode] = shape[head_mode] // group
    stride[head_mode] = stride[head_mode] * group
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))


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
    ((2, 2, 2), M, (V/2, N)): one k-block of 16 columns is two consecutive 8-column groups, so P can
    be fed to the P·V wgmma from registers without any data exchange between threads."""
    s, d = acc.layout.shape, acc.layout.stride
    assert s[0][2] % 2 == 0, "tile_n must be a multiple of 16"
    shape = ((s[0][0], s[0][1], 2), s[1], (s[0][2] // 2, s[2]))
    stride = ((d[0][0], d[0][1], d[0][2]), d[1], (d[0][2] * 2, d[2]))
    return cute.make_tensor(acc.iterator, cute.make_layout(shape, stride=stride))


@dsl_user_op
def _pack_pair(lo: Float32, hi: Float32, ptx_type: str, *, loc=None, ip=None) -> Int32:
    """Two fp32 values rounded to one 32-bit register of 16-bit values (lo in the low half)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [Float32(hi).ir_value(loc=loc, ip=ip), Float32(lo).ir_value(loc=loc, ip=ip)],
            f"cvt.rn.{ptx_type}x2.f32 $0, $1, $2;",
            "=r,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def convert_to_16bit(src: cute.Tensor, dst: cute.Tensor):
    """dst = src rounded to dst's 16-bit type, one cvt per pair of neighbours.

    `Tensor.load().to()` gives the same instructions, but LLVM then sinks them out of the main
    loop's body into the loop header (the loop carries 64 fp32 scores instead of 32 packed
    registers, and the conversions run in one block after the O rescale branch). An inline-asm
    conversion stays where it is written, among the exponentials."""
    ptx_type = "bf16" if cutlass.const_expr(dst.element_type is cutlass.BFloat16) else "f16"
    packed = cute.recast_tensor(dst, Int32)
    for i in cutlass.range_constexpr(cute.size(packed)):
        packed[i] = _pack_pair(src[2 * i], src[2 * i + 1], ptx_type)


def wgmma(tiled_mma, acc, frag_a, frag_b, accumulate: bool, wait: int) -> None:
    """Issue acc (+)= A·B over every k-block as one wgmma group; wait until at most `wait` groups
    are in flight (-1: do not wait)."""
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
