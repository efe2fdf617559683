"""FA4-style backward attention for Hopper (sm_90a) in the CuTe DSL: dK and dV of a block of keys
per CTA, dQ added into an fp32 accumulator.

A CTA takes `tile_n` rows of K and V of one K/V head and one batch:

* warpgroup 0 is the producer: one warp loads K and V once, then for every query head of the K/V
  head's group and every block of `tile_m` queries that sees the keys, Q, dO, and the LSE and D of
  those rows (LSE2 = LSE x log2(e), +inf where a row has no key; D = softmax_scale x rowsum(dO *
  O)) through a `num_stages` TMA + mbarrier pipeline;
* each consumer warpgroup owns 64 of the K rows. Per block it computes S^T = K Q^T and
  dP^T = V dO^T (wgmma, operands in shared memory), P^T = exp2(S^T x scale_log2 - LSE2) and
  dS^T = P^T (dP^T x softmax_scale - D) in registers, the softmax scale of both dQ and dK taken
  in the FFMA that subtracts D (masking keys past seqlen_k and, causal, above the bottom-right
  diagonal), then dV += P^T dO and dK += dS^T Q with P^T and dS^T as register A
  operands, and writes dS^T to shared memory. The warpgroups then compute dQ = dS K for the block
  together (each a slice of dQ's columns, A and B both MN-major in shared memory; with `dq_swap`
  as dQ^T = K^T dS^T, which takes 80-row Q blocks, each warpgroup 64 of dQ's columns) and add it
  into the fp32 dQ accumulator in global memory: `red.global.add` of column
  pairs, or with `deterministic` after the CTAs of the earlier K blocks (a semaphore per Q block,
  taken in the order of the K blocks: the sums come out the same on every run), or with `dq_tma`
  staged in shared memory (fp32) and added by one thread's TMA reductions, which run on while the
  next Q block is computed;
* at the end dK and dV leave through shared memory (K's and V's buffers) and a TMA
  store, which clips the rows past seqlen_k; keys that no query sees get zeros.

GQA needs no atomics for dK and dV: a CTA walks every query head of its K/V head's group and sums
their contributions in its accumulators. Head dims above 128 go in chunks (config.head_dim_chunk):
a CTA per K block and chunk of the head dim, S^T and dP^T over all of it, dK, dV and dQ of its
chunk (produce_chunks puts that chunk first in the shared buffers). With `persistent` a CTA per SM
takes the walks in their launch order (walks): every grid-th, or causal the next from the
stream's counter; a walk's first loads start under the last walk's end. Before it the
preprocessing kernel (preprocess.py) writes LSE2 and D and zeroes the dQ accumulator; the launch
(launch.py) casts it to dQ after (dq_flat: a cast kernel, postprocess.py, which also puts the
values back in place). The softmax scale costs no instruction of its own: not per dQ value in
every CTA that adds to it, nor in the cast, nor in dK's epilogue."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as hopper
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.cutlass_dsl import T, dsl_user_op

from ...problem import Problem
from ...target import Target, get_target
from ..sm90.helpers import (
    acc_as_operand_a,
    acc_rows_cols,
    convert_to_16bit,
    fetch_from_counter,
    permute_modes,
    smem_tile_layout,
    stages_as_rows,
    swap_first_modes,
    tma_pipeline,
    wgmma,
)
from . import config as cfg
from .config import BwdConfig

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}

# Named barrier ids (0 is __syncthreads), each of all consumer threads.
BARRIER_DS_FREE = 1  # every warpgroup's dQ GEMM has read dS^T: it may be written (ds_stages 1)
BARRIER_DS_FULL = 2  # every warpgroup's dS^T is in shared memory: the dQ GEMM may read it
BARRIER_DQ_TURN = 3  # deterministic: this CTA's turn to add to the Q block's dQ has come
BARRIER_DQ_DONE = 4  # deterministic: every thread's adds of this Q block are done
# persistent causal (never deterministic: the ids of the turn's two): the walk number is in its
# shared slot (the producer warp's to the consumers and the dQ warp), and every reader has read it
BARRIER_WALK_FULL = 3
BARRIER_WALK_EMPTY = 4
BARRIER_EPILOGUE = 5  # the staging of dK and dV in shared memory
BARRIER_DQ_FREE = 6  # dq_tma: the last TMA reduction has read sdQ: it may be written again
BARRIER_DQ_FULL = 7  # dq_tma: the Q block's dQ is in sdQ: the TMA reduction may read it
# dq_warp: per consumer warpgroup w (ids + w), each of its threads and the producer's dQ warp.
BARRIER_DQ_SLICE_FULL = 8  # the warpgroup's dQ slice is in sdQ: the dQ warp may reduce it
BARRIER_DQ_SLICE_EMPTY = 10  # the dQ warp's reduction has read the slice: it may be written
# + the warpgroup (12, 13): exp2_turns, the other warpgroup's exp2 is done: this one's may start
BARRIER_EXP2_TURN = 12
# dq_single, + the dS^T buffer, of both consumer warpgroups (the rules keep dq_single from
# exp2_turns, whose ids 12 and 13 it takes): one arrives and runs on, the other waits.
BARRIER_DS_SINGLE_FULL = 12  # the second warpgroup's dS^T is in the buffer: dQ's GEMM may read it
BARRIER_DS_SINGLE_FREE = 14  # the first warpgroup's dQ GEMM has read the buffer: it may be written
DQ_WARP = 1  # the producer warpgroup's warp that issues the dQ reductions (dq_warp)


def _reduce(instruction: str, constraints: str, operands: list) -> None:
    """One PTX reduction into global memory (no result): `operands` are the IR values of the
    address and of what it adds."""
    llvm.inline_asm(
        None,
        operands,
        instruction,
        constraints,
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def red_add_f32x2(pointer, a: Float32, b: Float32, *, loc=None, ip=None) -> None:
    """Atomically add (a, b) to the two fp32 values at `pointer` (8-byte aligned), one vector
    reduction in L2 (sm_90)."""
    _reduce(
        "red.global.add.v2.f32 [$0], {$1, $2};",
        "l,f,f",
        [
            pointer.toint(loc=loc, ip=ip).ir_value(),
            Float32(a).ir_value(loc=loc, ip=ip),
            Float32(b).ir_value(loc=loc, ip=ip),
        ],
    )


@dsl_user_op
def bulk_reduce_add_f32(gmem, smem, num_bytes: int, *, loc=None, ip=None) -> None:
    """Add `num_bytes` of fp32 values at shared address `smem` into those at global address
    `gmem` (both 16-byte aligned), one bulk reduction without a tensor map, in the issuing
    thread's bulk group (cp_async_bulk_commit_group and _wait_group as a TMA reduction)."""
    _reduce(
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        [
            gmem.toint(loc=loc, ip=ip).ir_value(),
            smem.toint(loc=loc, ip=ip).ir_value(),
            Int32(num_bytes).ir_value(loc=loc, ip=ip),
        ],
    )


@dsl_user_op
def red_add_f32(pointer, a: Float32, *, loc=None, ip=None) -> None:
    """Atomically add a to the fp32 value at `pointer`, a reduction in L2."""
    _reduce(
        "red.global.add.f32 [$0], $1;",
        "l,f",
        [pointer.toint(loc=loc, ip=ip).ir_value(), Float32(a).ir_value(loc=loc, ip=ip)],
    )


@dsl_user_op
def load_acquire(pointer, *, loc=None, ip=None) -> Int32:
    """An int32 read with acquire semantics at GPU scope (a semaphore's value)."""
    return Int32(
        llvm.inline_asm(
            T.i32(),
            [pointer.toint(loc=loc, ip=ip).ir_value()],
            "ld.global.acquire.gpu.b32 $0, [$1];",
            "=r,l",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@dsl_user_op
def release_add(pointer, value: Int32, *, loc=None, ip=None) -> None:
    """Add to an int32 with release semantics at GPU scope (a semaphore's turn passed on)."""
    _reduce(
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r",
        [pointer.toint(loc=loc, ip=ip).ir_value(), Int32(value).ir_value(loc=loc, ip=ip)],
    )


def dq_turn(n_block, m_block, seqlen_q, seqlen_k, tile_m: int, tile_n: int, causal: bool):
    """The deterministic mode's place of K block n_block among the adds into Q block m_block's dQ
    (FlashBackwardSm90.add_dq says why this order): n_block without a mask; causal, counted down
    from the last K block whose keys some query of the Q block sees (bottom-right). Plain ints or
    the kernel's Int32 alike."""
    if not causal:
        return n_block
    n_blocks = (seqlen_k + tile_n - 1) // tile_n
    reach = (m_block + 1) * tile_m + seqlen_k - seqlen_q
    return cutlass.min((reach + tile_n - 1) // tile_n, n_blocks) - 1 - n_block


def stat_position(row):
    """Where query row `row`'s LSE2 and D lie in their buffers (the preprocessing kernel writes them
    there, a Q block's TMA copies them to shared memory as they are): within each 16 rows, rows
    8 h + 2 q + e (h, e in 0..1, q in 0..3) at 4 q + 2 h + e. A consumer thread's S^T columns are
    8 j + 2 q + e for its lane's place q in its quad, so its four of a 16-row group lie side by
    side: one 128-bit load (stat_word), not two 64-bit ones. The Q blocks (64, 80 or 128 rows)
    are whole groups, so every row stays in its block. Plain ints or the kernel's Int32 alike."""
    return row - row % 16 + (row % 8) // 2 * 4 + (row % 16) // 8 * 2 + row % 2


def cta_coords(bx, by, bz, section_log2):
    """(x index of the walk, K/V head, batch) of the CTA at grid coordinates (bx, by, bz). The
    grid is (section x the x indices, K/V heads / section, batch), section = 2^section_log2 K/V
    heads, and the GPU starts CTAs in linear grid order: so a section's heads take each x index in
    turn, x 0 of every head of the section, then x 1, and so on, section after section. x is the
    K block (with the head dim in chunks, K block x chunks), so causal, where K block 0 walks the
    most Q blocks, the longest CTAs start first, not a head's longest after the earlier heads'
    shortest; the section keeps the Q, dO and dQ rows its CTAs share in the L2
    (launch.heads_per_section). A section of one head is the order of a grid of (x, K/V head,
    batch). Plain ints or the kernel's Int32 alike."""
    slot = bx & ((1 << section_log2) - 1)
    return bx >> section_log2, (by << section_log2) + slot, bz


def launch_order(n_block_index, seqlen_k, tile_n: int, deterministic: bool, causal: bool):
    """The K block of the CTA with grid x index n_block_index: the last K block first for the
    deterministic causal mode (add_dq), else in order."""
    if deterministic and causal:
        return (seqlen_k + tile_n - 1) // tile_n - 1 - n_block_index
    return n_block_index


class FlashBackwardSm90:
    """Compile-time config of one backward kernel. Shapes (batch, seqlens, heads) are run-time."""

    def __init__(
        self,
        config: BwdConfig,
        dtype: str,
        head_dim: int,
        causal: bool,
        target: Target | str | None = "H200",
    ):
        from . import FAMILY

        target = get_target(target)
        FAMILY.check(Problem(dtype=dtype, head_dim=head_dim, causal=causal), config, target)
        self.config = config
        self.dtype = DTYPES[Problem(dtype=dtype, head_dim=head_dim).dtype]
        self.head_dim = head_dim
        # The columns of dK, dV and dQ this kernel's CTAs compute: all of the head dim up to 128,
        # else one of its equal chunks per CTA (config.head_dim_chunk).
        self.dc = cfg.head_dim_chunk(head_dim)
        self.chunks = head_dim // self.dc
        self.causal = causal
        self.tile_m, self.tile_n = config.tile_m, config.tile_n
        self.num_stages = config.num_stages
        self.deterministic = config.deterministic
        self.dq_tma = config.dq_tma
        self.dq_warp = config.dq_warp
        self.dq_rows = config.dq_rows
        self.dq_swap = config.dq_swap
        self.parts = config.query_parts  # of a Q block, for S^T and dP^T (q_halves: 2)
        self.exp2_turns = config.exp2_turns
        self.dq_single = config.dq_single
        self.dq_wgs = config.dq_warpgroups  # that compute dQ, a slice of its columns each
        self.dq_flat = config.dq_flat
        self.split_loads = config.split_loads
        self.persistent = config.persistent
        self.dv_early = config.dv_early
        # causal walks differ in length: the CTAs take the next from a counter
        self.walk_counter = config.persistent and causal
        self.num_sms = target.sm_count
        # dq_flat: a warpgroup's slice of dQ in sdQ and in the accumulator, in slabs
        # (config.flat_slab: 64-row blocks of its columns, or with dq_swap the whole slice)
        self.flat_slab = cfg.flat_slab(config, head_dim)
        self.flat_blocks = 1 if config.dq_rows or config.dq_swap else config.tile_m // cfg.FLAT_ROWS
        self.part_m = config.tile_m // self.parts
        self.ds_stages = config.ds_stages
        self.wgs = config.consumer_warpgroups
        self.num_consumer_threads = cfg.THREADS_PER_WARPGROUP * self.wgs
        self.num_threads = cfg.THREADS_PER_WARPGROUP * (self.wgs + 1)
        self.producer_regs, self.consumer_regs = cfg.REGISTER_SPLIT[self.wgs]
        assert self.tile_m % 16 == 0, "stat_position keeps a Q block's rows in whole 16-row groups"
        self.early_lse, self.early_d = cfg.stats_in_registers(
            config, Problem(dtype=dtype, head_dim=head_dim, causal=causal)
        )

    # --------------------------------------------------------------------------------------------
    # Host side
    # --------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, nheads_q, d)
        mK: cute.Tensor,  # (batch, seqlen_k, nheads_kv, d)
        mV: cute.Tensor,  # (batch, seqlen_k, nheads_kv, d)
        mdO: cute.Tensor,  # (batch, seqlen_q, nheads_q, d)
        # LSE2 and D: (batch, nheads_q, seqlen_q padded to tile_m) fp32, rows at stat_position
        mLSE2: cute.Tensor,  # LSE x log2(e)
        mD: cute.Tensor,  # softmax_scale x (rowsum(dO * O) - dLSE)
        mdQacc: cute.Tensor,  # (batch, seqlen_q, nheads_q, d) fp32, zero: gets dQ
        mdK: cute.Tensor,  # (batch, seqlen_k, nheads_kv, d)
        mdV: cute.Tensor,  # (batch, seqlen_k, nheads_kv, d)
        mSemaphore: cute.Tensor | None,  # deterministic: (batch, nheads_q, Q blocks) int32, zero
        # persistent causal: (1,) int32, zero before the launch and after it (fetch_from_counter)
        mWalkCounter: cute.Tensor | None,
        softmax_scale_log2: Float32,
        softmax_scale: Float32,
        section_log2: Int32,
        stream: cuda.CUstream,
    ):
        # Seqlen-major views: (seqlen, dim, head, batch); LSE2 and D (seqlen, head, batch).
        mQ, mK, mV, mdO, mdQacc, mdK, mdV = [
            permute_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO, mdQacc, mdK, mdV)
        ]
        mLSE2, mD = [permute_modes(t, [2, 1, 0]) for t in (mLSE2, mD)]
        if const_expr(self.deterministic):
            mSemaphore = permute_modes(mSemaphore, [2, 1, 0])  # (Q blocks, head, batch)
        tile_m, tile_n, d, dc = self.tile_m, self.tile_n, self.head_dim, self.dc
        k_major, mn_major = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        # S^T = K Q^T and dP^T = V dO^T: each warpgroup 64 K rows, all tile_m queries (q_halves:
        # the queries of one part).
        mma_sdp = hopper.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            k_major,
            k_major,
            Float32,
            atom_layout_mnk=(self.wgs, 1, 1),
            tiler_mn=(64, self.part_m),
        )
        # dV += P^T dO and dK += dS^T Q: P^T and dS^T from registers, dO and Q read transposed.
        mma_dkv = hopper.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            k_major,
            mn_major,
            Float32,
            atom_layout_mnk=(self.wgs, 1, 1),
            tiler_mn=(64, dc),
            a_source=warpgroup.OperandSource.RMEM,
        )
        # dQ = dS K: dS^T and K in shared memory, both read transposed; each warpgroup a slice of
        # dQ's columns, or with dq_rows its 64 rows (tile_m is 64 per warpgroup). dq_swap: dQ^T =
        # K^T dS^T, K^T (M: 64 columns of dQ per warpgroup, the same slice) and dS (N: the Q
        # block's rows, 64 or 80) read from K's and dS^T's buffers, both MN-major as well.
        mma_dq = hopper.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            mn_major,
            mn_major,
            Float32,
            atom_layout_mnk=(self.wgs, 1, 1)
            if const_expr(self.dq_rows or self.dq_swap)
            else (1, self.dq_wgs, 1),
            tiler_mn=(64, dc)
            if const_expr(self.dq_rows)
            else ((64, tile_m) if const_expr(self.dq_swap) else (64, dc // self.dq_wgs)),
        )
        dq_cols = dc if const_expr(self.dq_rows) else dc // self.dq_wgs  # of a warpgroup's dQ
        # Q, dO, K and V whole (S^T and dP^T run over the head dim); the dK, dV and dQ GEMMs read
        # their first chunk of columns (where the producer puts the CTA's chunk: produce), so that
        # a swizzle atom divides the chunk.
        sQ_layout = smem_tile_layout(self.dtype, tile_m, d, self.num_stages, atom_cols=dc)
        sdO_layout = smem_tile_layout(self.dtype, tile_m, d, self.num_stages, atom_cols=dc)
        # The dQ GEMM reads K transposed, a slice of d columns per warpgroup: a swizzle atom that
        # divides the slice (head dim 96 over two warpgroups: 48 columns, 32-byte swizzle).
        sK_layout = smem_tile_layout(self.dtype, tile_n, d, atom_cols=dq_cols)
        sV_layout = smem_tile_layout(self.dtype, tile_n, d, atom_cols=dc)
        # One dS^T buffer unstaged (as before the knob), else a stage mode.
        sdS_layout = smem_tile_layout(
            self.dtype, tile_n, tile_m, self.ds_stages if const_expr(self.ds_stages > 1) else None
        )
        # A stage of LSE2 or D starts 128-byte aligned, as a TMA copy's shared address must (80
        # rows: 320 bytes, a stage of 96 values).
        stat_stage = cfg.stat_stage_rows(tile_m)
        sStat_layout = cute.make_layout((tile_m, self.num_stages), stride=(1, stat_stage))
        # dq_tma: the Q block's dQ in fp32, swizzled for the TMA reduction (and against bank
        # conflicts: row-major, the 8 rows of a warp's stores share 8 banks); each warpgroup writes
        # a slice of the columns, so the atom divides the slice (head dim 96: 48, 64-byte swizzle).
        # With dq_rows a tile of 64 rows per warpgroup (a stage each: its slice is contiguous).
        sdQ_layout = None
        if const_expr(self.dq_flat):  # each warpgroup's slice in its fragment order, unswizzled
            sdQ_layout = cute.make_layout(tile_m * dc)
        elif const_expr(self.dq_rows):
            sdQ_layout = smem_tile_layout(Float32, 64, dc, self.wgs)
        elif const_expr(self.dq_tma):
            sdQ_layout = smem_tile_layout(Float32, tile_m, dc, atom_cols=dc // self.dq_wgs)
        # Only dq_tma kernels get the buffer: the others' shared memory stays as it was.
        dq_field = (
            cute.struct.Align[
                cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], cfg.SMEM_ALIGN
            ]
            if const_expr(self.dq_tma)
            else cute.struct.MemRange[Float32, 0]
        )

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            if const_expr(self.split_loads):  # V's barrier pair and dO's per stage
                mbar_v: cute.struct.MemRange[cutlass.Int64, 2]
                mbar_do: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            if const_expr(self.walk_counter):  # the next walk's number (walks)
                walk_slot: cute.struct.MemRange[Int32, 1]
            sLSE: cute.struct.Align[
                cute.struct.MemRange[Float32, stat_stage * self.num_stages], cfg.SMEM_ALIGN
            ]
            sD: cute.struct.Align[
                cute.struct.MemRange[Float32, stat_stage * self.num_stages], cfg.SMEM_ALIGN
            ]
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], cfg.SMEM_ALIGN
            ]
            sdO: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], cfg.SMEM_ALIGN
            ]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], cfg.SMEM_ALIGN
            ]
            sV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], cfg.SMEM_ALIGN
            ]
            sdS: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], cfg.SMEM_ALIGN
            ]
            sdQ: dq_field

        load = cpasync.CopyBulkTensorTileG2SOp()
        store = cpasync.CopyBulkTensorTileS2GOp()
        one_stage = cute.select(sQ_layout, mode=[0, 1])
        if const_expr(self.chunks == 1):
            tma_q, tma_mQ = cpasync.make_tiled_tma_atom(load, mQ, one_stage, (tile_m, d))
            tma_do, tma_mdO = cpasync.make_tiled_tma_atom(
                load, mdO, cute.select(sdO_layout, mode=[0, 1]), (tile_m, d)
            )
            tma_k, tma_mK = cpasync.make_tiled_tma_atom(load, mK, sK_layout, (tile_n, d))
            tma_v, tma_mV = cpasync.make_tiled_tma_atom(load, mV, sV_layout, (tile_n, d))
        else:  # a box per chunk of columns (produce)
            q_chunk = smem_tile_layout(self.dtype, tile_m, dc)
            tma_q, tma_mQ = cpasync.make_tiled_tma_atom(load, mQ, q_chunk, (tile_m, dc))
            tma_do, tma_mdO = cpasync.make_tiled_tma_atom(load, mdO, q_chunk, (tile_m, dc))
            k_chunk = smem_tile_layout(self.dtype, tile_n, dc, atom_cols=dc // self.dq_wgs)
            v_chunk = smem_tile_layout(self.dtype, tile_n, dc)
            tma_k, tma_mK = cpasync.make_tiled_tma_atom(load, mK, k_chunk, (tile_n, dc))
            tma_v, tma_mV = cpasync.make_tiled_tma_atom(load, mV, v_chunk, (tile_n, dc))
        stat_one = cute.make_layout(tile_m)
        tma_lse, tma_mLSE = cpasync.make_tiled_tma_atom(load, mLSE2, stat_one, (tile_m,))
        tma_d, tma_mD = cpasync.make_tiled_tma_atom(load, mD, stat_one, (tile_m,))
        if const_expr(self.chunks == 1):
            tma_dk, tma_mdK = cpasync.make_tiled_tma_atom(store, mdK, sK_layout, (tile_n, d))
            tma_dv, tma_mdV = cpasync.make_tiled_tma_atom(store, mdV, sV_layout, (tile_n, d))
        else:  # the CTA's chunk, staged in the first chunk of K's and V's buffers
            tma_dk, tma_mdK = cpasync.make_tiled_tma_atom(store, mdK, k_chunk, (tile_n, dc))
            tma_dv, tma_mdV = cpasync.make_tiled_tma_atom(store, mdV, v_chunk, (tile_n, dc))
        tma_dq, tma_mdQ = None, None
        if const_expr(self.dq_tma and not self.dq_flat):
            # dq_warp: one reduction per warpgroup's slice of the columns (the slice is one column
            # of swizzle atoms of sdQ, contiguous, laid out as a tile of its own), or of the rows.
            dq_box = (tile_m, dc)
            if const_expr(self.dq_rows):
                dq_box = (64, dc)
            elif const_expr(self.dq_warp):
                dq_box = (tile_m, dc // self.dq_wgs)
            tma_dq, tma_mdQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(),
                mdQacc,
                smem_tile_layout(Float32, *dq_box) if const_expr(self.dq_warp) else sdQ_layout,
                dq_box,
            )
        bytes_kv = cute.size_in_bytes(self.dtype, sK_layout) + cute.size_in_bytes(
            self.dtype, sV_layout
        )
        bytes_q = 2 * cute.size_in_bytes(self.dtype, one_stage) + 2 * cute.size_in_bytes(
            Float32, stat_one
        )
        if const_expr(self.split_loads):  # K alone, Q and LSE2 alone (V and dO and D the same)
            bytes_kv = cute.size_in_bytes(self.dtype, sK_layout)
            bytes_q = cute.size_in_bytes(self.dtype, one_stage) + cute.size_in_bytes(
                Float32, stat_one
            )
        # (K block [x chunk] x head in the section, sections of K/V heads, batch): cta_coords.
        x_extent = cute.ceil_div(cute.size(mK.shape[0]), tile_n)
        if const_expr(self.chunks > 1):  # a CTA per K block and chunk, a K block's adjacent
            x_extent = x_extent * self.chunks
        grid = [
            x_extent << section_log2,
            cute.size(mK.shape[2]) >> section_log2,
            cute.size(mK.shape[3]),
        ]
        if const_expr(self.persistent):
            # One CTA per SM (the compile target's count: on a GPU with fewer SMs the surplus runs
            # as a second wave, right but slower), each taking every grid-th walk (walk_coords).
            grid = [cutlass.min(grid[0] * grid[1] * grid[2], self.num_sms), 1, 1]
        self.kernel(
            tma_mQ,
            tma_mK,
            tma_mV,
            tma_mdO,
            tma_mLSE,
            tma_mD,
            mdQacc,
            tma_mdQ,
            tma_mdK,
            tma_mdV,
            mSemaphore,
            mWalkCounter,
            tma_q,
            tma_k,
            tma_v,
            tma_do,
            tma_lse,
            tma_d,
            tma_dk,
            tma_dv,
            tma_dq,
            sQ_layout,
            sdO_layout,
            sK_layout,
            sV_layout,
            sdS_layout,
            sStat_layout,
            sdQ_layout,
            mma_sdp,
            mma_dkv,
            mma_dq,
            softmax_scale_log2,
            softmax_scale,
            section_log2,
            bytes_kv,
            bytes_q,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # --------------------------------------------------------------------------------------------
    # Device side
    # --------------------------------------------------------------------------------------------
    def m_block_range(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """[m_block_min, m_block_max): the Q blocks whose queries see some key of K block n_block
        (bottom-right causal: query i sees key j when j <= i + seqlen_k - seqlen_q)."""
        m_block_max = (seqlen_q + self.tile_m - 1) // self.tile_m
        m_block_min = Int32(0)
        if const_expr(self.causal):
            first_query = n_block * self.tile_n - (seqlen_k - seqlen_q)
            m_block_min = cutlass.max(first_query, 0) // self.tile_m
        return m_block_min, m_block_max

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE2: cute.Tensor,
        mD: cute.Tensor,
        mdQacc: cute.Tensor,
        mdQ: cute.Tensor | None,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mSemaphore: cute.Tensor | None,
        mWalkCounter: cute.Tensor | None,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_do: cute.CopyAtom,
        tma_lse: cute.CopyAtom,
        tma_d: cute.CopyAtom,
        tma_dk: cute.CopyAtom,
        tma_dv: cute.CopyAtom,
        tma_dq: cute.CopyAtom | None,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sStat_layout: cute.Layout,
        sdQ_layout: cute.ComposedLayout | cute.Layout | None,
        mma_sdp: cute.TiledMma,
        mma_dkv: cute.TiledMma,
        mma_dq: cute.TiledMma,
        softmax_scale_log2: Float32,
        softmax_scale: Float32,
        section_log2: Int32,
        bytes_kv: cutlass.Constexpr[int],
        bytes_q: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do, tma_lse, tma_d, tma_dk, tma_dv):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.dq_tma and not self.dq_flat):
                cpasync.prefetch_descriptor(tma_dq)
        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        warps = self.wgs * 4  # each consumer warp arrives once to release a stage
        pipe_kv = tma_pipeline(storage.mbar_kv.data_ptr(), 1, bytes_kv, warps)
        pipe_q = tma_pipeline(storage.mbar_q.data_ptr(), self.num_stages, bytes_q, warps)
        # split_loads: V, and each stage's dO and D, on barriers of their own (as many bytes as
        # K's, and as Q's and LSE2's)
        pipe_v = pipe_do = None
        if const_expr(self.split_loads):
            pipe_v = tma_pipeline(storage.mbar_v.data_ptr(), 1, bytes_kv, warps)
            pipe_do = tma_pipeline(storage.mbar_do.data_ptr(), self.num_stages, bytes_q, warps)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sLSE = storage.sLSE.get_tensor(sStat_layout)
        sD = storage.sD.get_tensor(sStat_layout)
        sdQ = None
        if const_expr(self.dq_flat):
            sdQ = storage.sdQ.get_tensor(sdQ_layout)
        elif const_expr(self.dq_tma):
            sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)

        role_args = (
            (tma_dk, tma_dv, mdK, mdV), section_log2, (mdQacc, mdQ, tma_dq, sdQ),
            softmax_scale_log2, softmax_scale, (mma_sdp, mma_dkv, mma_dq),
            (
                (tma_q, tma_k, tma_v, tma_do, tma_lse, tma_d),
                (mQ, mK, mV, mdO, mLSE2, mD),
                (sQ, sK, sV, sdO, sLSE, sD, sdS),
                (pipe_kv, pipe_v),
                (pipe_q, pipe_do),
            ),
        )  # fmt: skip
        if const_expr(self.persistent):
            slot = None
            if const_expr(self.walk_counter):
                slot = storage.walk_slot.get_tensor(cute.make_layout(1))
            self.walks(warp_idx, tidx, (mWalkCounter, slot), *role_args)
        else:
            self.one_walk(warp_idx, tidx, mSemaphore, *role_args)

    def walk_of(self, bx, by, bz, mQ: cute.Tensor, mK: cute.Tensor, section_log2):
        """(the walk, the chunk of the head dim, (seqlen_q, seqlen_k)) of the CTA at grid
        coordinates (bx, by, bz): its K block, K/V head and batch (cta_coords, launch_order), the
        query heads of its group and its Q blocks [m_block_min, + blocks_per_head), steps in all."""
        n_block, head_kv, batch = cta_coords(bx, by, bz, section_log2)
        chunk = 0  # of the head dim's columns, of dK, dV and dQ
        if const_expr(self.chunks > 1):
            chunk = n_block % self.chunks
            n_block = n_block // self.chunks
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        n_block = launch_order(n_block, seqlen_k, self.tile_n, self.deterministic, self.causal)
        group = mQ.shape[2] // mK.shape[2]
        m_block_min, m_block_max = self.m_block_range(n_block, seqlen_q, seqlen_k)
        blocks_per_head = m_block_max - m_block_min
        steps = cutlass.max(blocks_per_head, 0) * group
        walk = (n_block, head_kv, batch, group, m_block_min, blocks_per_head, steps)
        return walk, chunk, (seqlen_q, seqlen_k)

    @cute.jit
    def one_walk(
        self, warp_idx, tidx, mSemaphore, stores, section_log2, dq_out, softmax_scale_log2,
        softmax_scale, mmas, operands,
    ):  # fmt: skip
        """A CTA's one walk, that of its grid coordinates, in each role: the producer warp's
        loads, the dQ warp's reductions (dq_warp), the consumers' GEMMs and dK and dV."""
        atoms, tensors, smem, kv_pipes, q_pipes = operands
        mQ, mK = tensors[0], tensors[1]
        bx, by, bz = cute.arch.block_idx()
        walk, chunk, seqlens = self.walk_of(bx, by, bz, mQ, mK, section_log2)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                loads = (atoms, tensors, smem[:6], kv_pipes, q_pipes, walk)
                if const_expr(self.chunks == 1):
                    self.produce(*loads)
                else:
                    self.produce_chunks(*loads, chunk)
            if const_expr(self.dq_warp):
                if warp_idx == DQ_WARP:
                    mdQacc, mdQ, tma_dq, sdQ = dq_out
                    self.reduce_dq_slices(
                        tma_dq, mdQacc if const_expr(self.dq_flat) else mdQ, sdQ, mSemaphore,
                        seqlens, walk, chunk,
                    )  # fmt: skip
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(
                smem, mmas, kv_pipes, q_pipes, walk, seqlens, dq_out, mSemaphore, stores,
                softmax_scale_log2, softmax_scale, tidx - cfg.THREADS_PER_WARPGROUP, chunk,
            )  # fmt: skip

    def walk_coords(self, tile, mK: cute.Tensor, section_log2):
        """persistent: the grid coordinates (bx, by, bz) of walk `tile` of the walks in the
        order the one-walk kernel's grid launches them (x fastest: __call__'s grid)."""
        x_extent = (mK.shape[0] + self.tile_n - 1) // self.tile_n
        gx = x_extent << section_log2
        gy = mK.shape[2] >> section_log2
        rest = tile // gx
        return tile - rest * gx, rest % gy, rest // gy

    def walk_count(self, mK: cute.Tensor, section_log2):
        """persistent: the walks of the launch (the one-walk kernel's CTAs)."""
        x_extent = (mK.shape[0] + self.tile_n - 1) // self.tile_n
        return (x_extent << section_log2) * (mK.shape[2] >> section_log2) * mK.shape[3]

    def walk_at(self, tile, mQ: cute.Tensor, mK: cute.Tensor, section_log2):
        """persistent: walk_of of walk number `tile` (walk_coords)."""
        bx, by, bz = self.walk_coords(tile, mK, section_log2)
        return self.walk_of(bx, by, bz, mQ, mK, section_log2)

    def first_arrive(self, readers: int):
        """persistent, a reader (a consumer thread or the dQ warp): with the counter, the arrive
        that says the walk slot starts empty (the producer warp's first write waits for it)."""
        if const_expr(self.walk_counter):
            cute.arch.barrier_arrive(barrier_id=BARRIER_WALK_EMPTY, number_of_threads=readers + 32)

    @cute.jit
    def walks(
        self, warp_idx, tidx, counter, stores, section_log2, dq_out, softmax_scale_log2,
        softmax_scale, mmas, operands,
    ):  # fmt: skip
        """persistent: the CTA's walks in each role (one_walk's), the first that of its block
        index, the next every grid-th after it, or with the causal mask (walk_counter) the next
        from the counter, which the producer warp takes (fetch_from_counter) and hands to the
        consumers and the dQ warp through shared memory. The pipeline states run on from walk to
        walk; the consumers hand K's and V's buffers back once a walk's dK and dV have left
        through them, and the dQ warp hands the dQ slices back at a walk's end when another
        follows (consume's `later`). `counter`: (the counter, its shared slot), both None
        without it."""
        atoms, tensors, smem, kv_pipes, q_pipes = operands
        mQ, mK = tensors[0], tensors[1]
        mCounter, slot = counter
        stride = cute.arch.grid_dim()[0]
        first = cute.arch.block_idx()[0]
        count = self.walk_count(mK, section_log2)
        readers = self.num_consumer_threads + 32  # the consumers and the dQ warp
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                kv_p = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
                q_p = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.num_stages
                )
                tile_p = first
                while tile_p < count:
                    walk_p, _, _ = self.walk_at(tile_p, mQ, mK, section_log2)
                    kv_p, q_p = self.produce(
                        atoms, tensors, smem[:6], kv_pipes, q_pipes, walk_p, states=(kv_p, q_p)
                    )
                    if const_expr(self.walk_counter):
                        tile_p = fetch_from_counter(mCounter, count)
                        cute.arch.barrier(
                            barrier_id=BARRIER_WALK_EMPTY, number_of_threads=readers + 32
                        )
                        slot[0] = tile_p
                        cute.arch.barrier_arrive(
                            barrier_id=BARRIER_WALK_FULL, number_of_threads=readers + 32
                        )
                    else:
                        tile_p = tile_p + stride
            if const_expr(self.dq_warp):
                if warp_idx == DQ_WARP:
                    mdQacc, mdQ, tma_dq, sdQ = dq_out
                    tile_r = first
                    self.first_arrive(readers)
                    while tile_r < count:
                        walk_r, chunk_r, seqlens_r = self.walk_at(tile_r, mQ, mK, section_log2)
                        self.reduce_dq_slices(
                            tma_dq, mdQacc if const_expr(self.dq_flat) else mdQ, sdQ, None,
                            seqlens_r, walk_r, chunk_r,
                        )  # fmt: skip
                        tile_r = self.next_walk(tile_r, stride, count, slot, readers)
                        if tile_r < count:  # the slices back for the next walk's first step
                            for w in cutlass.range_constexpr(self.dq_wgs):
                                cute.arch.barrier_arrive(
                                    barrier_id=BARRIER_DQ_SLICE_EMPTY + w,
                                    number_of_threads=cfg.THREADS_PER_WARPGROUP + 32,
                                )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            kv_c = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            q_c = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            tile_c = first
            self.first_arrive(readers)
            while tile_c < count:
                walk_c, chunk_c, seqlens_c = self.walk_at(tile_c, mQ, mK, section_log2)
                kv_c, q_c = self.consume(
                    smem, mmas, kv_pipes, q_pipes, walk_c, seqlens_c, dq_out, None, stores,
                    softmax_scale_log2, softmax_scale, tidx - cfg.THREADS_PER_WARPGROUP, chunk_c,
                    states=(kv_c, q_c), later=tile_c != first,
                )  # fmt: skip
                tile_c = self.next_walk(tile_c, stride, count, slot, readers)

    @cute.jit
    def next_walk(self, tile, stride, count, slot, readers: int):
        """persistent: a reader's walk after `tile`: every grid-th, or with the counter the
        number the producer warp left in the slot (waited for, and the slot handed back unless
        there is no walk left, when the producer waits for it no more)."""
        nxt = tile + stride
        if const_expr(self.walk_counter):
            cute.arch.barrier(barrier_id=BARRIER_WALK_FULL, number_of_threads=readers + 32)
            nxt = slot[0]
            if nxt < count:
                cute.arch.barrier_arrive(
                    barrier_id=BARRIER_WALK_EMPTY, number_of_threads=readers + 32
                )
        return nxt

    @cute.jit
    def produce(self, atoms, tensors, smem, kv_pipes, q_pipes, walk, states=None):
        """K and V once, then Q, dO, LSE2 and D of each step (query head g of the group, Q block
        m), in the consumers' order. split_loads: K, then the first step's Q and LSE2, V, its dO
        and D, each pair on its own barrier, then every later step's Q and LSE2, dO and D.
        persistent (walks): `states` the pipeline states to go on from, returned advanced past
        the walk; K and V after the first step's Q, dO, LSE2 and D (the last walk's dK and dV
        leave through K's and V's buffers; the first Q and dO need not wait for that), and for a
        walk of no steps still (its consumers wait for them and store zeros through them)."""
        pipe_kv, pipe_v = kv_pipes
        pipe_q, pipe_do = q_pipes
        tma_q, tma_k, tma_v, tma_do, tma_lse, tma_d = atoms
        n_block, head_kv, batch, group, m_block_min, blocks_per_head, steps = walk

        if const_expr(states is None):
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        else:
            kv_state, q_state = states
        kv = self.kv_boxes(atoms, tensors, smem, n_block, head_kv, batch)
        if const_expr(not self.persistent):
            barrier = self.load_kv(atoms, pipe_kv, kv_state, kv, with_v=not self.split_loads)
            q_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.num_stages
            )
        else:  # the step loop's barrier typed before it (the DSL carries names through loops)
            barrier = pipe_q.producer_get_barrier(q_state)
        first = None
        if const_expr(self.split_loads or self.persistent):
            first = Int32(1)  # V (persistent: K and V) follow the first step's Q
        for g in cutlass.range(group, unroll=1):
            for m_block in cutlass.range(m_block_min, m_block_min + blocks_per_head, unroll=1):
                (tQsQ, tQgQ), (tdOsdO, tdOgdO), (tLsL, tLgL), (tDsD, tDgD) = self.step_boxes(
                    atoms, tensors, smem, head_kv * group + g, batch, m_block
                )
                pipe_q.producer_acquire(q_state)
                barrier = pipe_q.producer_get_barrier(q_state)
                stage = q_state.index
                cute.copy(tma_q, tQgQ, tQsQ[None, stage], tma_bar_ptr=barrier)
                cute.copy(tma_lse, tLgL, tLsL[None, stage], tma_bar_ptr=barrier)
                if const_expr(self.split_loads):
                    if first == 1:
                        (tVsV, tVgV) = kv[1]
                        pipe_v.producer_acquire(kv_state)
                        cute.copy(
                            tma_v, tVgV, tVsV, tma_bar_ptr=pipe_v.producer_get_barrier(kv_state)
                        )
                        first = Int32(0)
                    pipe_do.producer_acquire(q_state)
                    barrier = pipe_do.producer_get_barrier(q_state)
                cute.copy(tma_do, tdOgdO, tdOsdO[None, stage], tma_bar_ptr=barrier)
                cute.copy(tma_d, tDgD, tDsD[None, stage], tma_bar_ptr=barrier)
                q_state.advance()
                if const_expr(self.persistent):
                    if first == 1:
                        self.load_kv(atoms, pipe_kv, kv_state, kv, with_v=True)
                        first = Int32(0)
        if const_expr(self.persistent):
            if first == 1:
                self.load_kv(atoms, pipe_kv, kv_state, kv, with_v=True)
            kv_state.advance()
        return kv_state, q_state

    def load_kv(self, atoms, pipe_kv, kv_state, kv, with_v: bool):
        """The walk's K (and V) on K's barrier, once the consumers have handed the buffers back;
        returns the barrier."""
        (tKsK, tKgK), (tVsV, tVgV) = kv
        pipe_kv.producer_acquire(kv_state)
        barrier = pipe_kv.producer_get_barrier(kv_state)
        cute.copy(atoms[1], tKgK, tKsK, tma_bar_ptr=barrier)
        if with_v:
            cute.copy(atoms[2], tVgV, tVsV, tma_bar_ptr=barrier)
        return barrier

    def step_boxes(self, atoms, tensors, smem, head, batch, m_block):
        """The TMA partitions (shared, global) of a step's Q, dO, LSE2 and D: query head `head`,
        Q block m_block (the shared ones with their stage mode)."""
        tma_q, _, _, tma_do, tma_lse, tma_d = atoms
        mQ, _, _, mdO, mLSE2, mD = tensors
        sQ, _, _, sdO, sLSE, sD = smem
        one_cta, d = cute.make_layout(1), self.head_dim
        gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, d), (m_block, 0))
        gdO = cute.local_tile(mdO[None, None, head, batch], (self.tile_m, d), (m_block, 0))
        gLSE = cute.local_tile(mLSE2[None, head, batch], (self.tile_m,), (m_block,))
        gD = cute.local_tile(mD[None, head, batch], (self.tile_m,), (m_block,))
        # each pair unpacked as it is made (the IR's order as before this helper)
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_q, 0, one_cta, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2)
        )
        tdOsdO, tdOgdO = cpasync.tma_partition(
            tma_do, 0, one_cta, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2)
        )
        tLsL, tLgL = cpasync.tma_partition(tma_lse, 0, one_cta, sLSE, gLSE)
        tDsD, tDgD = cpasync.tma_partition(tma_d, 0, one_cta, sD, gD)
        return (tQsQ, tQgQ), (tdOsdO, tdOgdO), (tLsL, tLgL), (tDsD, tDgD)

    def kv_boxes(self, atoms, tensors, smem, n_block, head_kv, batch):
        """The TMA partitions (shared, global) of the walk's K and V."""
        _, tma_k, tma_v, _, _, _ = atoms
        _, mK, mV, _, _, _ = tensors
        _, sK, sV, _, _, _ = smem
        one_cta, d = cute.make_layout(1), self.head_dim
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, d), (n_block, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, d), (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(  # unpacked as made (step_boxes)
            tma_k, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2)
        )
        tVsV, tVgV = cpasync.tma_partition(
            tma_v, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2)
        )
        return (tKsK, tKgK), (tVsV, tVgV)

    def chunk_boxes(self, atom, s, g, rows: int, block, chunk) -> list:
        """(shared, global) TMA partitions of each chunk i of the columns of s (with a stage mode
        when it has one): chunk (chunk + i) % chunks of g's block of rows."""
        out = []
        for i in range(self.chunks):  # traced inline (a plain method: its loop is Python's)
            if cute.rank(s) == 3:
                shared = cute.local_tile(s, (rows, self.dc, self.num_stages), (0, i, 0))
            else:
                shared = cute.local_tile(s, (rows, self.dc), (0, i))
            glob = cute.local_tile(g, (rows, self.dc), (block, (chunk + i) % self.chunks))
            out.append(
                cpasync.tma_partition(
                    atom,
                    0,
                    cute.make_layout(1),
                    cute.group_modes(shared, 0, 2),
                    cute.group_modes(glob, 0, 2),
                )  # fmt: skip
            )
        return out

    @cute.jit
    def produce_chunks(self, atoms, tensors, smem, kv_pipes, q_pipes, walk, chunk: Int32):
        """produce, for a head dim in chunks: a box per chunk of columns, the CTA's chunk first.
        Shared chunk i holds the columns of chunk (chunk + i) % chunks, in the same order in Q,
        dO, K and V (S^T and dP^T sum over all of them, in any order), so that the dK, dV and dQ
        GEMMs read the CTA's chunk at the start of each buffer. (Not with split_loads: the rules
        refuse it with chunks.)"""
        pipe_kv, _ = kv_pipes
        pipe_q, _ = q_pipes
        tma_q, tma_k, tma_v, tma_do, tma_lse, tma_d = atoms
        mQ, mK, mV, mdO, mLSE2, mD = tensors
        sQ, sK, sV, sdO, sLSE, sD = smem
        n_block, head_kv, batch, group, m_block_min, blocks_per_head, steps = walk
        one_cta = cute.make_layout(1)
        chunks, stages = self.chunks, self.num_stages
        tile_m, tile_n = self.tile_m, self.tile_n

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        k_boxes = self.chunk_boxes(
            tma_k, sK, mK[None, None, head_kv, batch], tile_n, n_block, chunk
        )
        v_boxes = self.chunk_boxes(
            tma_v, sV, mV[None, None, head_kv, batch], tile_n, n_block, chunk
        )
        pipe_kv.producer_acquire(kv_state)
        barrier = pipe_kv.producer_get_barrier(kv_state)
        for i in cutlass.range_constexpr(chunks):
            cute.copy(tma_k, k_boxes[i][1], k_boxes[i][0], tma_bar_ptr=barrier)
            cute.copy(tma_v, v_boxes[i][1], v_boxes[i][0], tma_bar_ptr=barrier)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
        for g in cutlass.range(group, unroll=1):
            for m_block in cutlass.range(m_block_min, m_block_min + blocks_per_head, unroll=1):
                head = head_kv * group + g
                q_boxes = self.chunk_boxes(
                    tma_q, sQ, mQ[None, None, head, batch], tile_m, m_block, chunk
                )
                do_boxes = self.chunk_boxes(
                    tma_do, sdO, mdO[None, None, head, batch], tile_m, m_block, chunk
                )
                gLSE = cute.local_tile(mLSE2[None, head, batch], (tile_m,), (m_block,))
                gD = cute.local_tile(mD[None, head, batch], (tile_m,), (m_block,))
                tLsL, tLgL = cpasync.tma_partition(tma_lse, 0, one_cta, sLSE, gLSE)
                tDsD, tDgD = cpasync.tma_partition(tma_d, 0, one_cta, sD, gD)
                pipe_q.producer_acquire(q_state)
                barrier = pipe_q.producer_get_barrier(q_state)
                stage = q_state.index
                for i in cutlass.range_constexpr(chunks):
                    cute.copy(tma_q, q_boxes[i][1], q_boxes[i][0][None, stage], tma_bar_ptr=barrier)
                cute.copy(tma_lse, tLgL, tLsL[None, stage], tma_bar_ptr=barrier)
                for i in cutlass.range_constexpr(chunks):
                    cute.copy(
                        tma_do, do_boxes[i][1], do_boxes[i][0][None, stage], tma_bar_ptr=barrier
                    )
                cute.copy(tma_d, tDgD, tDsD[None, stage], tma_bar_ptr=barrier)
                q_state.advance()

    # ---- consumers -----------------------------------------------------------------------------
    @cute.jit
    def consume(
        self,
        smem,
        mmas,
        kv_pipes,
        q_pipes,
        walk,
        seqlens,
        dq_out,
        mSemaphore: cute.Tensor | None,
        stores,
        softmax_scale_log2: Float32,
        softmax_scale: Float32,
        ctid: Int32,
        chunk,
        states=None,
        later=None,
    ):
        """Every step's five GEMMs and the softmax gradient, then dK and dV out (of the CTA's
        chunk of the head dim: the first chunk of Q's, dO's and K's buffers, produce_chunks).
        persistent (walks): `states` the pipeline states the walk starts from, `later` whether
        the CTA walked before; K's and V's buffers go back to the producer once dK and dV have
        left through them. Returns the states."""
        sQ, sK, sV, sdO, sLSE, sD, sdS = smem
        mma_sdp, mma_dkv, mma_dq = mmas
        pipe_kv, pipe_v = kv_pipes
        pipe_q, pipe_do = q_pipes
        n_block, head_kv, batch, group, m_block_min, blocks_per_head, steps = walk
        seqlen_q, seqlen_k = seqlens
        mdQacc, mdQ, tma_dq, sdQ = dq_out
        if const_expr(self.dq_rows and not self.dq_flat):  # the warpgroups' 64-row tiles, seen
            sdQ = stages_as_rows(sdQ)  # as the Q block's
        tile_m, tile_n, dc = self.tile_m, self.tile_n, self.dc
        wg = cute.arch.make_warp_uniform(ctid // cfg.THREADS_PER_WARPGROUP)
        sQc, sdOc, sKc = sQ, sdO, sK  # the CTA's chunk of their columns
        if const_expr(self.chunks > 1):
            sQc = cute.local_tile(sQ, (tile_m, dc, self.num_stages), (0, 0, 0))
            sdOc = cute.local_tile(sdO, (tile_m, dc, self.num_stages), (0, 0, 0))
            sKc = cute.local_tile(sK, (tile_n, dc), (0, 0))

        # Per part of the Q block (q_halves: two of 64 queries, else one of all): its queries in
        # Q's and dO's buffers, as the B operands of S^T and dP^T and (transposed) of dK and dV.
        parts, pm = self.parts, self.part_m
        wg_sdp = mma_sdp.get_slice(wg * cfg.THREADS_PER_WARPGROUP)
        thr_sdp = mma_sdp.get_slice(ctid)
        tSrK = wg_sdp.make_fragment_A(wg_sdp.partition_A(sK))
        tSrQ = [
            wg_sdp.make_fragment_B(wg_sdp.partition_B(self.part_rows(sQ, p))) for p in range(parts)
        ]
        tdPrV = wg_sdp.make_fragment_A(wg_sdp.partition_A(sV))
        tdPrdO = [
            wg_sdp.make_fragment_B(wg_sdp.partition_B(self.part_rows(sdO, p))) for p in range(parts)
        ]
        s_shape = wg_sdp.partition_shape_C((tile_n, pm))
        # One m64 x part wgmma per warpgroup: the 16-bit operand view of S^T's and dP^T's
        # accumulators (acc_as_operand_a) keeps the accumulator's register order (dS^T below).
        assert cute.size(s_shape[1]) == 1 and cute.size(s_shape[2]) == 1, s_shape

        wg_dkv = mma_dkv.get_slice(wg * cfg.THREADS_PER_WARPGROUP)
        tdVrdOt = [
            wg_dkv.make_fragment_B(wg_dkv.partition_B(swap_first_modes(self.part_rows(sdOc, p))))
            for p in range(parts)
        ]
        tdKrQt = [
            wg_dkv.make_fragment_B(wg_dkv.partition_B(swap_first_modes(self.part_rows(sQc, p))))
            for p in range(parts)
        ]
        tdVrP = [
            wg_dkv.make_fragment_A(wg_dkv.partition_shape_A((tile_n, pm))) for _ in range(parts)
        ]
        tdKrdS = [
            wg_dkv.make_fragment_A(wg_dkv.partition_shape_A((tile_n, pm))) for _ in range(parts)
        ]
        acc_dV = cute.make_rmem_tensor(wg_dkv.partition_shape_C((tile_n, dc)), Float32)
        acc_dK = cute.make_rmem_tensor(wg_dkv.partition_shape_C((tile_n, dc)), Float32)

        # dq_single: the dQ GEMM is the first warpgroup's (its 128 threads), the second has none.
        dq_tid = ctid % cfg.THREADS_PER_WARPGROUP if const_expr(self.dq_single) else ctid
        wg_dq = mma_dq.get_slice(
            0 if const_expr(self.dq_single) else wg * cfg.THREADS_PER_WARPGROUP
        )
        thr_dq = mma_dq.get_slice(dq_tid)
        # dQ's tile (rows, columns) as the GEMM computes it: (queries, columns of dQ), or
        # swapped (columns of dQ, queries); the coordinates this thread's values have in it.
        dq_tile = (dc, tile_m) if const_expr(self.dq_swap) else (tile_m, dc)
        if const_expr(self.dq_swap):
            tdQrKt = wg_dq.make_fragment_A(wg_dq.partition_A(swap_first_modes(sKc)))
            tdQrdS = wg_dq.make_fragment_B(wg_dq.partition_B(swap_first_modes(sdS)))
        else:
            tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(swap_first_modes(sdS)))
            tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(swap_first_modes(sKc)))
        dq_shape = wg_dq.partition_shape_C(dq_tile)
        dq_coords = acc_rows_cols(thr_dq.partition_C(cute.make_identity_tensor(dq_tile)))

        # dS^T from registers into shared memory (rows: keys, columns: queries).
        ds_store = cute.make_tiled_copy_C(
            cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
            ),
            mma_sdp,
        ).get_slice(ctid)
        tdSsdS = [ds_store.partition_D(self.part_cols(sdS, p)) for p in range(parts)]
        # Where this thread's S^T values of each part lie in the (tile_n, tile_m) block: key row,
        # query column.
        s_coords = [
            acc_rows_cols(
                thr_sdp.partition_C(self.part_cols(cute.make_identity_tensor((tile_n, tile_m)), p))
            )
            for p in range(parts)
        ]
        s_cols = cute.size(s_coords[0], mode=[1])
        # Only the K block that ends past seqlen_k and, causal, the blocks that reach above the
        # Q block's first query's diagonal (key_end - 1 > m_block x tile_m + seqlen_k - seqlen_q)
        # need the mask (the rows past seqlen_q have LSE2 = +inf, so their P is 0 anyway): the
        # Q blocks below mask_end, decided once per CTA, so that a step's test is one compare
        # (ptxas recomputed the K block's own test from the block index at every step).
        key_end = (n_block + 1) * tile_n
        mask_end = Int32(0)
        if const_expr(self.causal):
            reach = key_end - 1 - (seqlen_k - seqlen_q)  # the Q blocks that start below it
            mask_end = cutlass.max(reach + tile_m - 1, 0) // tile_m
        if key_end > seqlen_k:
            mask_end = m_block_min + blocks_per_head

        if const_expr(states is None):
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            q_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.num_stages
            )
        else:
            kv_state, q_state = states
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        if const_expr(later is not None):
            # A walk after the CTA's first: its first dQ slice waits, as every later step's does
            # (stage_dq_slice), for the dQ warp to have read the last one, the last walk's.
            if later:
                if wg < self.dq_wgs:
                    cute.arch.barrier(
                        barrier_id=BARRIER_DQ_SLICE_EMPTY + wg,
                        number_of_threads=cfg.THREADS_PER_WARPGROUP + 32,
                    )
        pipe_kv.consumer_wait(kv_state)
        # exp2_turns: the first warpgroup's first exp2 waits for nothing (the second warpgroup's
        # turn given ahead, taken back after the last step), the second's for the first's.
        if const_expr(self.exp2_turns):
            if wg == 1:
                self.pass_exp2_turn(1 - wg)
        # The steps: each query head of the group (g), each of its Q blocks. Causal, the masked
        # ones are each head's first mask_end - m_block_min, counted down from the head's start
        # (tested as m_block < mask_end, ptxas rebuilt mask_end from the block index at every
        # step). Without the causal mask every step of the CTA is masked or none is: one test of
        # the CTA's first Q block, held in a predicate (as key_end > seqlen_k, ptxas rebuilt it
        # too). Two loops, not one over the steps: that took an integer division per step.
        step = Int32(0)
        for g in cutlass.range(group, unroll=1):
            mask_left = mask_end - m_block_min
            for m_block in cutlass.range(m_block_min, m_block_min + blocks_per_head, unroll=1):
                head = head_kv * group + g
                stage = q_state.index
                masked = m_block_min < mask_end
                if const_expr(self.causal):
                    masked = mask_left > 0
                pipe_q.consumer_wait(q_state)
                # The LSE2 of this thread's query columns into registers before the GEMMs, where
                # they fit (config.stats_in_registers): read after the wait for S^T, its loads stall
                # the exp2's FFMAs.
                lse = [None] * parts
                if const_expr(self.early_lse):
                    # (col0 of stat_word: the thread's first query column)
                    lse[0] = self.stat_words(sLSE, stage, s_coords[0][0, 0][1], s_cols, 0)
                sdp_operands = (mma_sdp, s_shape, tSrK, tSrQ, tdPrV, tdPrdO)
                acc_S, acc_dP = [None] * parts, [None] * parts
                # split_loads: dP^T waits for the stage's dO (and at the first step V), S^T not
                loads = None
                if const_expr(self.split_loads):
                    loads = (pipe_v, kv_state, pipe_do, q_state)
                acc_S[0], acc_dP[0] = self.part_gemms(
                    sdp_operands, 0, stage, wait=1, dp_loads=loads
                )
                # Each part: P^T and dS^T in registers, dS^T into shared memory, dV and dK
                # (q_halves: the first part's dV and dK GEMMs queued behind the second part's S^T
                # and dP^T, so that they run while its exp2 does; the last part's dK as below).
                tdSsdS_step, tdQrdS_step = tdSsdS, tdQrdS
                for p in cutlass.range_constexpr(parts):
                    # S^T and dP^T as (key rows, query columns); the thread's first column
                    # within its 16-query group (of the part's first)
                    scores, grads = acc_rows_cols(acc_S[p]), acc_rows_cols(acc_dP[p])
                    col0 = s_coords[p][0, 0][1]
                    if const_expr(p > 0):
                        col0 = col0 - p * pm
                    dsum = self.softmax_exp(
                        scores, s_coords[p], col0, sLSE, sD, stage, lse[p], masked, n_block,
                        m_block, seqlen_q, seqlen_k, softmax_scale_log2, p * pm // 16, wg,
                    )  # fmt: skip
                    # dv_early: the last part's dV GEMM queued behind its dP^T before its dS^T is
                    # made, so that the tensor pipe runs it while this warpgroup computes dS^T (its
                    # operand registers are not written again until the GEMM is waited for); the
                    # first part's (q_halves) is queued behind the second part's S^T and dP^T.
                    dv_now = self.dv_early and p + 1 == parts
                    dp_wait = 0 if p == 0 else 2
                    if const_expr(dv_now):
                        convert_to_16bit(acc_as_operand_a(acc_S[p]), tdVrP[p])
                        wgmma(
                            mma_dkv, acc_dV, tdVrP[p], tdVrdOt[p][None, None, None, stage],
                            accumulate=True, wait=-1,
                        )  # fmt: skip
                        dp_wait = dp_wait + 1
                    self.softmax_ds(
                        scores, grads, col0, sD, stage, dsum, softmax_scale, p * pm // 16,
                        dp_wait,
                    )  # fmt: skip
                    if const_expr(not dv_now):
                        convert_to_16bit(acc_as_operand_a(acc_S[p]), tdVrP[p])
                    convert_to_16bit(acc_as_operand_a(acc_dP[p]), tdKrdS[p])
                    # The stmatrix copy of dS^T reads the dK GEMM's operand registers in the
                    # accumulator's order (the same registers: one m64 wgmma per warpgroup, so the
                    # operand view of the accumulator keeps its order), not a second conversion of
                    # dP^T.
                    rdS = cute.make_tensor(tdKrdS[p].iterator, acc_dP[p].layout)
                    if const_expr(p + 1 < parts):
                        if const_expr(self.early_lse):
                            lse[p + 1] = self.stat_words(
                                sLSE, stage, s_coords[0][0, 0][1], s_cols, (p + 1) * pm // 16
                            )
                        acc_S[p + 1], acc_dP[p + 1] = self.part_gemms(
                            sdp_operands, p + 1, stage, wait=-1
                        )
                    if const_expr(p == 0):
                        # dS^T's buffer is free once every warpgroup's last dQ GEMM has read it.
                        # With two buffers this one was last read two steps ago, before every
                        # warpgroup reached the last step's DS_FULL barrier.
                        if const_expr(self.ds_stages == 1):
                            cute.arch.barrier(
                                barrier_id=BARRIER_DS_FREE,
                                number_of_threads=self.num_consumer_threads,
                            )
                        else:
                            ds = step % self.ds_stages
                            tdSsdS_step = [t[None, None, None, ds] for t in tdSsdS]
                            tdQrdS_step = tdQrdS[None, None, None, ds]
                            if const_expr(self.dq_single):
                                # the second warpgroup, up to a step ahead: this buffer's last
                                # reader was the first warpgroup's dQ GEMM two steps ago
                                if wg == 1 and step >= 2:
                                    self.ds_single(BARRIER_DS_SINGLE_FREE + ds, arrive=False)
                    cute.copy(ds_store, ds_store.retile(rdS), tdSsdS_step[p])
                    if const_expr(p + 1 == parts):
                        cute.arch.fence_view_async_shared()
                    if const_expr(not dv_now):
                        wgmma(
                            mma_dkv, acc_dV, tdVrP[p], tdVrdOt[p][None, None, None, stage],
                            accumulate=True, wait=-1,
                        )  # fmt: skip
                    if const_expr(p + 1 < parts or not self.dq_tma):
                        wgmma(
                            mma_dkv, acc_dK, tdKrdS[p], tdKrQt[p][None, None, None, stage],
                            accumulate=True, wait=-1,
                        )  # fmt: skip
                    if const_expr(p + 1 < parts):
                        # the next part's S^T is done (its dP^T, this part's dV and dK may run)
                        warpgroup.wait_group(3)
                if const_expr(self.dq_single):
                    # the first warpgroup waits for the second's dS^T; the second runs on
                    if wg == 1:
                        self.ds_single(BARRIER_DS_SINGLE_FULL + step % 2, arrive=True)
                    else:
                        self.ds_single(BARRIER_DS_SINGLE_FULL + step % 2, arrive=False)
                else:
                    cute.arch.barrier(
                        barrier_id=BARRIER_DS_FULL, number_of_threads=self.num_consumer_threads
                    )
                acc_dQ = cute.make_rmem_tensor(dq_shape, Float32)
                dq_a, dq_b = tdQrdS_step, tdQrKt
                if const_expr(self.dq_swap):
                    dq_a, dq_b = tdQrKt, tdQrdS_step
                if const_expr(self.dq_single):
                    self.single_dq_and_dk(
                        (mma_dq, mma_dkv), acc_dQ, acc_dK, (dq_a, dq_b), tdKrdS[parts - 1],
                        tdKrQt[parts - 1][None, None, None, stage], sdQ, step, wg, ctid,
                    )  # fmt: skip
                    self.release_stage(pipe_q, pipe_do, q_state)
                    q_state.advance()
                elif const_expr(self.dq_tma):
                    # dQ before dK, so that dQ is staged and reduced while the dK GEMM runs.
                    wgmma(mma_dq, acc_dQ, dq_a, dq_b, accumulate=False, wait=-1)
                    wgmma(
                        mma_dkv, acc_dK, tdKrdS[parts - 1],
                        tdKrQt[parts - 1][None, None, None, stage], accumulate=True, wait=1,
                    )  # fmt: skip
                    if const_expr(self.dq_warp):
                        self.stage_dq_slice(acc_dQ, mma_dq, sdQ, step, wg, ctid)
                    else:
                        self.reduce_dq(
                            acc_dQ, mma_dq, sdQ, tma_dq, mdQ, m_block, head, batch, ctid, chunk
                        )
                    warpgroup.wait_group(0)
                    self.release_stage(pipe_q, pipe_do, q_state)
                    q_state.advance()
                else:
                    wgmma(mma_dq, acc_dQ, dq_a, dq_b, accumulate=False, wait=0)
                    self.release_stage(pipe_q, pipe_do, q_state)
                    q_state.advance()
                    self.add_dq(
                        acc_dQ, dq_coords, mdQacc, mSemaphore, n_block, m_block, head, batch,
                        seqlen_q, seqlen_k, ctid, chunk,
                    )  # fmt: skip
                step = step + 1
                if const_expr(self.causal):
                    mask_left = mask_left - 1
        if const_expr(self.exp2_turns):
            if wg == 0:
                self.take_exp2_turn(wg)
        if const_expr(self.dq_single):
            # the first warpgroup's last two frees, which no later step of the second waited for
            if wg == 1:
                for back in cutlass.range_constexpr(2, 0, -1):
                    if steps >= back:
                        self.ds_single(BARRIER_DS_SINGLE_FREE + (steps - back) % 2, arrive=False)
        if const_expr(self.dq_tma and not self.dq_warp):
            if ctid < 32:  # sdQ stays allocated until the last reduction has read it
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        self.epilogue(acc_dK, acc_dV, smem, mma_dkv, stores, n_block, head_kv, batch, ctid,
                      chunk)  # fmt: skip
        if const_expr(states is not None):
            # K's and V's buffers back to the producer: each warp's arrive follows its part of
            # the staging, the first warp's its wait for the stores to have read them (epilogue).
            pipe_kv.consumer_release(kv_state)
            kv_state.advance()
        return kv_state, q_state

    def part_gemms(self, operands, p: int, stage, wait: int, dp_loads=None):
        """(S^T, dP^T) of part p of the Q block in `stage`: fresh accumulators, a wgmma group
        each; `wait` as wgmma's after the second. dp_loads (split_loads, the first part): (V's
        pipeline and state, dO's pipeline and the stage's state), waited for between the two
        (V's once loaded, its wait passes at once)."""
        mma_sdp, s_shape, tSrK, tSrQ, tdPrV, tdPrdO = operands
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        wgmma(mma_sdp, acc_S, tSrK, tSrQ[p][None, None, None, stage], accumulate=False, wait=-1)
        if const_expr(dp_loads is not None):
            pipe_v, v_state, pipe_do, do_state = dp_loads
            pipe_v.consumer_wait(v_state)
            pipe_do.consumer_wait(do_state)
        acc_dP = cute.make_rmem_tensor(s_shape, Float32)
        wgmma(
            mma_sdp, acc_dP, tdPrV, tdPrdO[p][None, None, None, stage], accumulate=False, wait=wait
        )
        return acc_S, acc_dP

    def release_stage(self, pipe_q, pipe_do, q_state):
        """The step's Q stage handed back to the producer (split_loads: its dO stage too)."""
        pipe_q.consumer_release(q_state)
        if const_expr(self.split_loads):
            pipe_do.consumer_release(q_state)

    def part_rows(self, t: cute.Tensor, p: int) -> cute.Tensor:
        """Part p's queries of a Q-block buffer (queries, columns, stages) (q_halves; else t)."""
        if const_expr(self.parts == 1):
            return t
        return cute.local_tile(t, (self.part_m, t.shape[1], t.shape[2]), (p, 0, 0))

    def part_cols(self, t: cute.Tensor, p: int) -> cute.Tensor:
        """Part p's queries of a (keys, queries[, stages]) tile: dS^T's buffer, S^T's
        coordinates (q_halves; else t)."""
        if const_expr(self.parts == 1):
            return t
        if const_expr(cute.rank(t) == 3):
            return cute.local_tile(t, (t.shape[0], self.part_m, t.shape[2]), (0, p, 0))
        return cute.local_tile(t, (t.shape[0], self.part_m), (0, p))

    def stat_word(self, sStat: cute.Tensor, stage, col0, word: int) -> cute.Tensor:
        """(4,) registers: the LSE2 or D (sStat) of this thread's query columns 4 word .. 4 word +
        3 (S^T's columns in coords' mode-1 order, c = pair + 2 x 8-column group), in one 128-bit
        load: stat_position puts them side by side, at 16 word + 2 col0 of the stage's rows
        (col0: the thread's first column, 2 x its lane's place in its quad). The stage's start
        comes from sStat's layout (a stage may be padded past tile_m for the TMA's alignment)."""
        stage_stride = sStat.layout.stride[1]
        offset = cute.assume(stage * stage_stride + 2 * col0 + 16 * word, divby=4)
        out = cute.make_rmem_tensor(4, Float32)
        cute.autovec_copy(cute.make_tensor(sStat.iterator + offset, cute.make_layout(4)), out)
        return out

    def stat_words(self, sStat: cute.Tensor, stage, col0, cols: int, word0: int) -> cute.Tensor:
        """(cols,) registers: stat_word of every word of this thread's columns from word0 (a
        part's first: 16-column groups), in column order."""
        out = cute.make_rmem_tensor(cute.make_layout((4, cols // 4)), Float32)
        for w in range(cols // 4):  # traced inline
            word = self.stat_word(sStat, stage, col0, word0 + w)
            for i in range(4):
                out[i, w] = word[i]
        return out

    @cute.jit
    def softmax_exp(
        self,
        scores: cute.Tensor,
        coords: cute.Tensor,
        col0: Int32,
        sLSE: cute.Tensor,
        sD: cute.Tensor,
        stage: Int32,
        lse: cute.Tensor | None,
        masked,
        n_block: Int32,
        m_block: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        softmax_scale_log2: Float32,
        word0: cutlass.Constexpr[int],
        wg: Int32,
    ):
        """P^T = exp2(S^T x scale_log2 - LSE2) in place of S^T (`scores`: the accumulator seen as
        key rows x query columns; 0 for keys past seqlen_k and, causal, above the diagonal).
        Returns the D of this thread's columns where it is read early (early_d), else None: for
        softmax_ds. col0: the thread's first column within its 16-query group.
        lse: None, or (early_lse) the LSE2 of this thread's columns (coords' mode 1) already in
        registers. masked: the step's keys need the mask (consume's mask_end). word0: the first
        16-query group of the columns (of a part, q_halves) in the LSE2 and D buffers. wg: this
        thread's warpgroup (exp2_turns: the exp2 waits for its turn and then passes it on)."""
        rows, cols = cute.size(scores, mode=[0]), cute.size(scores, mode=[1])
        # early_d: D of the columns read before the exp2, so that its loads land while they run
        # (read after the wait for dP^T, they stall dS^T's FADDs); else there, one at a time.
        dsum = None
        if const_expr(self.early_d):
            dsum = self.stat_words(sD, stage, col0, cols, word0)
        # A key is seen while key0 + key row < limit (seqlen_k; causal, also the column's query +
        # diagonal + 1). This thread's key rows are its first one, row0, plus compile-time offsets:
        # compared as offset < limit - key0 - row0 (one bound per column, then one compare with an
        # immediate per score, no key held per score).
        row0 = coords[0, 0][0]
        diagonal = seqlen_k - seqlen_q
        if const_expr(self.exp2_turns):
            self.take_exp2_turn(wg)
        # Unmasked steps skip the compare and select per score.
        if masked:
            bound_k = seqlen_k - n_block * self.tile_n - row0
            causal_base = m_block * self.tile_m + diagonal + 1 - n_block * self.tile_n - row0
            word = None
            for c in cutlass.range_constexpr(cols):
                col = coords[0, c][1]
                if const_expr(not self.early_lse and c % 4 == 0):
                    word = self.stat_word(sLSE, stage, col0, word0 + c // 4)
                lse_c = lse[c] if const_expr(self.early_lse) else word[c % 4]
                bound = bound_k
                if const_expr(self.causal):
                    bound = cutlass.min(bound, causal_base + col)
                for r in cutlass.range_constexpr(rows):
                    s = -Float32.inf if coords[r, 0][0] - row0 >= bound else scores[r, c]
                    scores[r, c] = cute.math.exp2(s * softmax_scale_log2 - lse_c, fastmath=True)
        else:
            word = None
            for c in cutlass.range_constexpr(cols):
                if const_expr(not self.early_lse and c % 4 == 0):
                    word = self.stat_word(sLSE, stage, col0, word0 + c // 4)
                lse_c = lse[c] if const_expr(self.early_lse) else word[c % 4]
                for r in cutlass.range_constexpr(rows):
                    scores[r, c] = cute.math.exp2(
                        scores[r, c] * softmax_scale_log2 - lse_c, fastmath=True
                    )
        if const_expr(self.exp2_turns):
            self.pass_exp2_turn(1 - wg)
        return dsum

    @cute.jit
    def softmax_ds(
        self,
        scores: cute.Tensor,
        grads: cute.Tensor,
        col0: Int32,
        sD: cute.Tensor,
        stage: Int32,
        dsum: cute.Tensor | None,
        softmax_scale: Float32,
        word0: cutlass.Constexpr[int],
        dp_wait: cutlass.Constexpr[int],
    ):
        """dS^T = P^T (dP^T x softmax_scale - D) in place of dP^T (`grads`, seen as `scores`
        is; D comes scaled: one FFMA and one FMUL per value), once dP^T's wgmma is done (wgmma
        groups in flight after it: dp_wait). P^T is softmax_exp's, in `scores`; dsum: what it
        returned (D of the columns with early_d, else None)."""
        rows, cols = cute.size(scores, mode=[0]), cute.size(scores, mode=[1])
        warpgroup.wait_group(dp_wait)
        word = None
        for c in cutlass.range_constexpr(cols):
            if const_expr(not self.early_d and c % 4 == 0):
                word = self.stat_word(sD, stage, col0, word0 + c // 4)
            d_col = dsum[c] if const_expr(self.early_d) else word[c % 4]
            for r in cutlass.range_constexpr(rows):
                grads[r, c] = scores[r, c] * (grads[r, c] * softmax_scale - d_col)

    def take_exp2_turn(self, wg: Int32):
        """exp2_turns: wait until warpgroup `wg`'s turn at the exp2 has been passed to it."""
        cute.arch.barrier(
            barrier_id=BARRIER_EXP2_TURN + wg, number_of_threads=2 * cfg.THREADS_PER_WARPGROUP
        )

    @cute.jit
    def single_dq_and_dk(
        self, mmas, acc_dQ, acc_dK, dq_ab, dk_a, dk_b, sdQ, step: Int32, wg: Int32, ctid: Int32
    ):
        """dq_single, after the step's dS^T: in the first warpgroup the dQ GEMM and the last dK
        GEMM, dS^T's buffer handed back to the second warpgroup once dQ's has read it, and dQ
        staged for the dQ warp while dK's runs (as without dq_single); in the second the dK GEMM
        alone. Each warpgroup issues its wgmmas in its own branch: with the dK GEMM after a branch
        for dQ's, ptxas serialized every wgmma (C7514) and spilled at head dim 96."""
        mma_dq, mma_dkv = mmas
        if wg == 0:
            wgmma(mma_dq, acc_dQ, dq_ab[0], dq_ab[1], accumulate=False, wait=-1)
            wgmma(mma_dkv, acc_dK, dk_a, dk_b, accumulate=True, wait=1)
            self.ds_single(BARRIER_DS_SINGLE_FREE + step % 2, arrive=True)
            self.stage_dq_slice(acc_dQ, mma_dq, sdQ, step, 0, ctid)
            warpgroup.wait_group(0)
        else:
            wgmma(mma_dkv, acc_dK, dk_a, dk_b, accumulate=True, wait=0)

    def ds_single(self, barrier_id, arrive: bool):
        """dq_single: a named barrier of both consumer warpgroups, one arriving (running on), the
        other waiting."""
        if const_expr(arrive):
            cute.arch.barrier_arrive(
                barrier_id=barrier_id, number_of_threads=2 * cfg.THREADS_PER_WARPGROUP
            )
        else:
            cute.arch.barrier(
                barrier_id=barrier_id, number_of_threads=2 * cfg.THREADS_PER_WARPGROUP
            )

    def pass_exp2_turn(self, to: Int32):
        """exp2_turns: give warpgroup `to` its turn at the exp2 (this warpgroup's is done)."""
        cute.arch.barrier_arrive(
            barrier_id=BARRIER_EXP2_TURN + to, number_of_threads=2 * cfg.THREADS_PER_WARPGROUP
        )

    @cute.jit
    def add_dq(
        self,
        acc_dQ: cute.Tensor,
        coords: cute.Tensor,
        mdQacc: cute.Tensor,
        mSemaphore: cute.Tensor | None,
        n_block: Int32,
        m_block: Int32,
        head: Int32,
        batch: Int32,
        seqlen_q: Int32,
        seqlen_k: Int32,
        ctid: Int32,
        chunk,
    ):
        """This thread's share of the Q block's dQ into the fp32 accumulator, a pair of adjacent
        columns per reduction; deterministic: in a fixed order of the K blocks, this CTA's turn
        when the Q block's count of adds reaches it.

        The order is the one in which the CTAs reach the Q block if they run side by side. Without
        a mask every CTA walks the Q blocks from the first: K blocks 0, 1, 2, ... (each CTA a step
        behind the one before). Causal, a K block's walk starts at its diagonal Q block, so the
        Q block's last visitor (the K block on its diagonal) gets there first, at its first step,
        and the earlier K blocks follow, each tile_n / tile_m steps later in its own walk: the order
        is descending, and the CTAs are launched last K block first (the kernel's prologue), so
        that none waits on a CTA launched after it. In ascending order every CTA's first add waited
        for K block 0 to walk down to its diagonal (measured 0.29-0.37x the atomic adds, causal)."""
        if const_expr(self.deterministic):
            turn = dq_turn(n_block, m_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n,
                           self.causal)  # fmt: skip
            if ctid == 0:
                pointer = mSemaphore[None, head, batch].iterator + self.turn_slot(m_block, chunk)
                seen = load_acquire(pointer)
                while seen != turn:
                    seen = load_acquire(pointer)
            cute.arch.barrier(
                barrier_id=BARRIER_DQ_TURN, number_of_threads=self.num_consumer_threads
            )
        values = acc_rows_cols(acc_dQ)
        gdQ = mdQacc[None, None, head, batch]
        query0 = m_block * self.tile_m
        if const_expr(self.dq_swap):
            # dQ^T: a thread's value pairs are adjacent queries, a row of the accumulator apart,
            # so one add per value; its columns are the queries (the same for every row), each
            # its own test of seqlen_q, taken only in a Q block that ends past it (a branch per
            # query in every block otherwise).
            if query0 + self.tile_m <= seqlen_q:
                self.add_dq_swapped(values, coords, gdQ, query0, None, chunk)
            else:
                self.add_dq_swapped(values, coords, gdQ, query0, seqlen_q, chunk)
        else:
            for r in cutlass.range_constexpr(cute.size(values, mode=[0])):
                query = query0 + coords[r, 0][0]
                if query < seqlen_q:
                    for c in cutlass.range_constexpr(0, cute.size(values, mode=[1]), 2):
                        col = coords[r, c][1]
                        if const_expr(self.chunks > 1):
                            col = col + chunk * self.dc
                        pointer = gdQ.iterator + cute.crd2idx((query, col), gdQ.layout)
                        red_add_f32x2(pointer, values[r, c], values[r, c + 1])
        if const_expr(self.deterministic):
            cute.arch.fence_acq_rel_gpu()
            cute.arch.barrier(
                barrier_id=BARRIER_DQ_DONE, number_of_threads=self.num_consumer_threads
            )
            if ctid == 0:
                slot = self.turn_slot(m_block, chunk)
                release_add(mSemaphore[None, head, batch].iterator + slot, Int32(1))

    @cute.jit
    def add_dq_swapped(self, values, coords, gdQ, query0, seqlen_q, chunk):
        """add_dq's adds of dQ^T's values (coords: (column of dQ, query)), one at a time; with
        seqlen_q (not None) only those of queries before it."""
        for c in cutlass.range_constexpr(cute.size(values, mode=[1])):
            query = query0 + coords[0, c][1]
            if const_expr(seqlen_q is None):
                self.add_dq_column(values, coords, gdQ, query, c, chunk)
            elif query < seqlen_q:
                self.add_dq_column(values, coords, gdQ, query, c, chunk)

    @cute.jit
    def add_dq_column(self, values, coords, gdQ, query, c: int, chunk):
        for r in cutlass.range_constexpr(cute.size(values, mode=[0])):
            col = coords[r, c][0]
            if const_expr(self.chunks > 1):
                col = col + chunk * self.dc
            pointer = gdQ.iterator + cute.crd2idx((query, col), gdQ.layout)
            red_add_f32(pointer, values[r, c])

    @cute.jit
    def reduce_dq(
        self,
        acc_dQ: cute.Tensor,
        mma_dq: cute.TiledMma,
        sdQ: cute.Tensor,
        tma_dq: cute.CopyAtom,
        mdQ: cute.Tensor,
        m_block: Int32,
        head: Int32,
        batch: Int32,
        ctid: Int32,
        chunk,
    ):
        """dq_tma: the Q block's dQ into sdQ (each thread its accumulator's values), then one
        thread adds the whole block into the fp32 accumulator with a TMA reduction, which clips the
        rows past seqlen_q and runs on while the next block is computed. sdQ is written again only
        once that thread has seen the previous reduction read it. The first consumer warp issues
        it: the DSL elects one of its threads (elect.sync over the whole warp, which one thread
        alone must not execute)."""
        if ctid < 32:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        cute.arch.barrier(barrier_id=BARRIER_DQ_FREE, number_of_threads=self.num_consumer_threads)
        self.stage_dq(acc_dQ, mma_dq, sdQ, ctid)
        cute.arch.barrier(barrier_id=BARRIER_DQ_FULL, number_of_threads=self.num_consumer_threads)
        if ctid < 32:
            if const_expr(self.chunks == 1):
                gdQ = cute.local_tile(
                    mdQ[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0)
                )
            else:
                gdQ = cute.local_tile(
                    mdQ[None, None, head, batch], (self.tile_m, self.dc), (m_block, chunk)
                )
            tsdQ, tgdQ = cpasync.tma_partition(
                tma_dq, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2),
                cute.group_modes(gdQ, 0, 2),
            )  # fmt: skip
            cute.copy(tma_dq, tsdQ, tgdQ)
            cute.arch.cp_async_bulk_commit_group()

    @cute.jit
    def stage_dq(self, acc_dQ: cute.Tensor, mma_dq: cute.TiledMma, sdQ: cute.Tensor, ctid: Int32):
        """This thread's dQ values into sdQ (its warpgroup's columns), visible to TMA after.
        dq_swap: dQ^T's values into sdQ seen transposed, one at a time (a thread's pairs are
        adjacent queries, a row of sdQ apart; sdQ stays row-major for the TMA reduction)."""
        if const_expr(self.dq_flat):
            self.stage_dq_flat(acc_dQ, sdQ, ctid)
            return
        bits, sdQ_mma = 64, sdQ
        if const_expr(self.dq_swap):
            bits, sdQ_mma = 32, swap_first_modes(sdQ)
        dq_store = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=bits),
            mma_dq,
        ).get_slice(ctid)
        cute.copy(dq_store, dq_store.retile(acc_dQ), dq_store.partition_D(sdQ_mma))
        cute.arch.fence_view_async_shared()

    @cute.jit
    def stage_dq_flat(self, acc_dQ: cute.Tensor, sdQ: cute.Tensor, ctid: Int32):
        """dq_flat: this thread's dQ values into its warpgroup's slice of sdQ in their register
        order, four at a time (an 8-column group's two rows of two columns: config.flat_dq_offset),
        visible to the bulk reductions after. Thread t of the warpgroup puts the values of its
        group q at q x 512 + 4 t: one 16-byte store per group, a warp's 512 contiguous bytes."""
        threads = cfg.THREADS_PER_WARPGROUP
        slice_values = self.tile_m * self.dc // self.dq_wgs
        base = sdQ.iterator + (ctid // threads) * slice_values + (ctid % threads) * 4
        for q in cutlass.range_constexpr(cute.size(acc_dQ) // 4):
            values = cute.make_rmem_tensor(4, Float32)
            for i in cutlass.range_constexpr(4):
                values[i] = acc_dQ[4 * q + i]
            cute.autovec_copy(
                values, cute.make_tensor((base + q * 4 * threads).align(16), cute.make_layout(4))
            )
        cute.arch.fence_view_async_shared()

    @cute.jit
    def stage_dq_slice(
        self,
        acc_dQ: cute.Tensor,
        mma_dq: cute.TiledMma,
        sdQ: cute.Tensor,
        step: Int32,
        wg: Int32,
        ctid: Int32,
    ):
        """dq_warp: this warpgroup's slice of the Q block's dQ (its columns, with dq_rows its rows)
        into sdQ once the dQ warp has read the last one out (not before the first step), then
        handed to the dQ warp. Only the warpgroup and the dQ warp meet: the other warpgroup runs
        on."""
        slice_threads = cfg.THREADS_PER_WARPGROUP + 32
        if step > 0:
            cute.arch.barrier(
                barrier_id=BARRIER_DQ_SLICE_EMPTY + wg, number_of_threads=slice_threads
            )
        self.stage_dq(acc_dQ, mma_dq, sdQ, ctid)
        cute.arch.barrier_arrive(
            barrier_id=BARRIER_DQ_SLICE_FULL + wg, number_of_threads=slice_threads
        )

    def turn_slot(self, m_block, chunk):
        """The deterministic mode's semaphore of Q block m_block's dQ (with the head dim in
        chunks, one per chunk of its columns: their adds are independent)."""
        if const_expr(self.chunks == 1):
            return m_block
        return m_block * self.chunks + chunk

    def dq_column(self, w: int, chunk):
        """The column tile of warpgroup w's slice of dQ in the accumulator (slices of dc /
        warpgroups columns)."""
        if const_expr(self.chunks == 1):
            return w
        return chunk * self.dq_wgs + w

    def dq_slice(self, t: cute.Tensor, m_block, w: int, chunk=0) -> cute.Tensor:
        """Warpgroup w's slice of Q block m_block's dQ in t: in sdQ (m_block 0, chunk 0) or in
        the accumulator (at the CTA's chunk of the columns): its columns, or with dq_rows its 64
        rows (in sdQ a tile of their own; dq_rows takes head dim 64, one chunk)."""
        if const_expr(not self.dq_rows):
            cols = self.dc // self.dq_wgs
            return cute.local_tile(t, (self.tile_m, cols), (m_block, self.dq_column(w, chunk)))
        if const_expr(cute.rank(t) == 3):  # sdQ: a stage per warpgroup
            return t[None, None, w]
        return cute.local_tile(t, (64, self.dc), (m_block * self.wgs + w, 0))

    @cute.jit
    def reduce_flat_slice(
        self, mdQacc: cute.Tensor, sdQ: cute.Tensor, m_block, head, batch, w: int, chunk
    ):
        """dq_flat, one thread of the dQ warp: warpgroup w's staged slice of Q block m_block's dQ
        added into the accumulator, a bulk reduction per slab of it. The accumulator (the
        launch's (batch, rows padded to the Q tile, heads, head dim) fp32, its memory in
        config.flat_dq_offset's order) holds per (batch, head) its blocks of a slab's rows, each
        in slices of a slab's columns (config.flat_slab: 64 rows by flat_width columns, or with
        dq_swap the Q block's rows by 64 columns)."""
        rows, width, _ = self.flat_slab
        block_values = rows * width
        blocks = mdQacc.shape[0] // rows  # the accumulator's rows, padded to the Q tile
        heads = mdQacc.shape[2]
        slices = self.head_dim // width
        column = 0 if const_expr(self.dq_rows) else self.dq_column(w, chunk)
        slice_values = self.tile_m * self.dc // self.dq_wgs
        for b in cutlass.range_constexpr(self.flat_blocks):
            row_block = m_block * self.wgs + w
            if const_expr(not self.dq_rows):
                row_block = m_block * self.flat_blocks + b
            block = (cutlass.Int64(batch) * heads + head) * blocks + row_block
            offset = (block * slices + column) * block_values
            bulk_reduce_add_f32(
                (mdQacc.iterator + offset).align(16),
                (sdQ.iterator + w * slice_values + b * block_values).align(16),
                block_values * 4,
            )

    @cute.jit
    def reduce_dq_slices(
        self,
        tma_dq: cute.CopyAtom,
        mdQ: cute.Tensor,
        sdQ: cute.Tensor,
        mSemaphore: cute.Tensor | None,
        seqlens,
        walk,
        chunk,
    ):
        """dq_warp, the producer warpgroup's warp DQ_WARP: per step, each consumer warpgroup's
        slice of dQ into the fp32 accumulator with a TMA reduction (which clips the rows past
        seqlen_q; dq_flat: bulk reductions, reduce_flat_slice) as soon as that warpgroup has
        staged it; a slice is handed back once its
        reduction has read it (the reductions themselves run on). The whole warp executes the
        copies (the DSL elects the issuing thread).

        Deterministic: the warp issues a Q block's reductions at this CTA's turn (dq_turn, as
        add_dq) and passes the turn on once they have completed (their adds performed, not only
        their reads of sdQ); the consumers wait for it only when they next need the slice."""
        n_block, head_kv, batch, group, m_block_min, blocks_per_head, steps = walk
        seqlen_q, seqlen_k = seqlens
        slice_threads = cfg.THREADS_PER_WARPGROUP + 32
        lane = cute.arch.lane_idx()
        # One loop over the steps, with an integer division each, not a loop per query head:
        # that spilled at 128x128s1-det-tma-w-ds2 (this warp has the producers' registers).
        for step in cutlass.range(steps, unroll=1):
            g = step // blocks_per_head
            m_block = m_block_min + (step - g * blocks_per_head)
            gdQ = None
            if const_expr(not self.dq_flat):
                gdQ = mdQ[None, None, head_kv * group + g, batch]
            if const_expr(self.deterministic):
                turn = dq_turn(n_block, m_block, seqlen_q, seqlen_k, self.tile_m, self.tile_n,
                               self.causal)  # fmt: skip
                slot = self.turn_slot(m_block, chunk)
                pointer = mSemaphore[None, head_kv * group + g, batch].iterator + slot
                if lane == 0:
                    seen = load_acquire(pointer)
                    while seen != turn:
                        seen = load_acquire(pointer)
                cute.arch.sync_warp()
            for w in cutlass.range_constexpr(self.dq_wgs):
                cute.arch.barrier(
                    barrier_id=BARRIER_DQ_SLICE_FULL + w, number_of_threads=slice_threads
                )
                if const_expr(self.dq_flat):
                    if lane == 0:
                        self.reduce_flat_slice(
                            mdQ, sdQ, m_block, head_kv * group + g, batch, w, chunk
                        )
                else:
                    tsdQ, tgdQ = cpasync.tma_partition(
                        tma_dq,
                        0,
                        cute.make_layout(1),
                        cute.group_modes(self.dq_slice(sdQ, 0, w), 0, 2),
                        cute.group_modes(self.dq_slice(gdQ, m_block, w, chunk), 0, 2),
                    )
                    cute.copy(tma_dq, tsdQ, tgdQ)
                cute.arch.cp_async_bulk_commit_group()
            if const_expr(self.deterministic):
                cute.arch.cp_async_bulk_wait_group(0, read=False)  # the adds performed
                cute.arch.fence_acq_rel_gpu()
                if lane == 0:
                    release_add(pointer, Int32(1))
                cute.arch.sync_warp()
            if step < steps - 1:  # the consumers wait for a slice only before their next step
                for w in cutlass.range_constexpr(self.dq_wgs):
                    cute.arch.cp_async_bulk_wait_group(self.dq_wgs - 1 - w, read=True)
                    cute.arch.barrier_arrive(
                        barrier_id=BARRIER_DQ_SLICE_EMPTY + w, number_of_threads=slice_threads
                    )
        cute.arch.cp_async_bulk_wait_group(0, read=True)  # sdQ stays until read

    @cute.jit
    def epilogue(
        self,
        acc_dK: cute.Tensor,
        acc_dV: cute.Tensor,
        smem,
        mma_dkv: cute.TiledMma,
        stores,
        n_block: Int32,
        head_kv: Int32,
        batch: Int32,
        ctid: Int32,
        chunk,
    ):
        """dK and dV (complete: dS^T carries the softmax scale) through K's and V's buffers (free
        once every warpgroup's last GEMM has read them) and a TMA store each, which clips the rows
        past seqlen_k. With the head dim in chunks: the CTA's chunk, through the buffers' first
        chunk."""
        sQ, sK, sV, sdO, sLSE, sD, sdS = smem
        tma_dk, tma_dv, mdK, mdV = stores
        d, column = self.head_dim, 0
        if const_expr(self.chunks > 1):
            d, column = self.dc, chunk
            sK = cute.local_tile(sK, (self.tile_n, d), (0, 0))
            sV = cute.local_tile(sV, (self.tile_n, d), (0, 0))
        rdK = cute.make_rmem_tensor_like(acc_dK, self.dtype)
        rdK.store(acc_dK.load().to(self.dtype))
        rdV = cute.make_rmem_tensor_like(acc_dV, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        cute.arch.barrier(barrier_id=BARRIER_EPILOGUE, number_of_threads=self.num_consumer_threads)
        store_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        thr_store = cute.make_tiled_copy_C(store_atom, mma_dkv).get_slice(ctid)
        cute.copy(thr_store, thr_store.retile(rdK), thr_store.partition_D(sK))
        cute.copy(thr_store, thr_store.retile(rdV), thr_store.partition_D(sV))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BARRIER_EPILOGUE, number_of_threads=self.num_consumer_threads)
        if ctid < 32:
            one_cta = cute.make_layout(1)
            gdK = cute.local_tile(
                mdK[None, None, head_kv, batch], (self.tile_n, d), (n_block, column)
            )
            gdV = cute.local_tile(
                mdV[None, None, head_kv, batch], (self.tile_n, d), (n_block, column)
            )
            tKsK, tKgK = cpasync.tma_partition(
                tma_dk, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gdK, 0, 2)
            )
            tVsV, tVgV = cpasync.tma_partition(
                tma_dv, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gdV, 0, 2)
            )
            cute.copy(tma_dk, tKsK, tKgK)
            cute.copy(tma_dv, tVsV, tVgV)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
