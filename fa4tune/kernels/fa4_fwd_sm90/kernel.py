"""FA4-style forward attention for Hopper (sm_90a) in the CuTe DSL.

A CTA computes (tile_m rows of Q) x (one head) x (one batch) tiles of O and their LSE, one tile (or,
with `persistent`, one after another):

* warpgroup 0 is the producer: after setmaxnreg lowers its registers, one warp loads each tile's Q
  and its K/V blocks through a `num_stages` TMA + mbarrier pipeline;
* warpgroups 1..tile_m/64 are consumers, 64 rows of Q each, with more registers. They issue
  S = Q K^T (both operands in shared memory) and O += P V (P from registers) as wgmma, and run the
  online softmax in registers between the two;
* with `wg_pingpong` the consumers take turns issuing GEMMs through named barriers, so that one
  warpgroup's softmax runs under another's GEMMs; with `intra_wg_overlap` each consumer issues its
  next S GEMM before the softmax of the current one (the PV GEMM of step j overlaps the softmax of
  step j+1);
* the softmax rescales O only when a row max rose by more than `rescale_threshold`, and takes
  `emu_share` of its exponentials on the FMA pipe (a degree-`poly_degree` polynomial);
* with `lazy_max`, after a tile's first block the softmax exponentiates against the running max
  without first taking the block's row max (../sm90/softmax.py says how a rise is caught); a warp
  whose P overflowed recomputes its scores from Q and K in shared memory, so K's stage is released
  after the softmax instead of right after the S GEMM;
* causal masking is applied only to the K blocks that cross the diagonal (bottom-right aligned), and
  blocks above the diagonal are never loaded; causal tiles are scheduled longest first, grouped by
  heads so that the K/V of the heads in flight stay in L2;
* with three or four consumer warpgroups (tile_m 192 or 256), a warpgroup whose rows all lie past
  the end of Q (in the last m block) issues no GEMM and no exponential: it only waits for and
  releases the K/V stages and passes the GEMM turns, so the warpgroups with rows have the tensor
  cores and the MUFU to themselves (not in persistent non-causal kernels, where it measured slower);
* O leaves through shared memory (Q's buffer, or with `persistent` a buffer of its own) and a TMA
  store; with `wg_epilogue` each consumer warpgroup has its own buffer and store and waits for no
  other warpgroup there; LSE is written per row;
* with `persistent` the grid is one CTA per SM and each CTA walks the tiles: the producer loads the
  next tile's Q and K/V while the consumers finish this one, so the prologue and epilogue of a tile
  hide under its neighbours' main loops. The consumers release Q once the tile's S GEMMs are done
  (after its last GEMM without `intra_wg_overlap`); with `q_stages` 2, Q has two buffers and the
  next tile's Q loads once the producer has issued this tile's last K/V, while this tile's S GEMMs
  still read the other buffer, instead of after them. Non-causal tiles all cost the same and go to
  the CTAs with a fixed stride. Causal tiles differ in length, so a fixed stride would let the CTAs
  drift apart in the longest-first order (and the heads in flight out of L2): each CTA's producer
  takes its next tile from a global counter instead (an atomic add) and hands the number to its
  consumers through shared memory. The counter starts at zero and the last fetch of a launch puts it
  back to zero.

With `pack_gqa` the rows of a tile are the (query head in the group, query) pairs of one K/V head
(sm90/helpers.pack_rows: a view of Q, O and LSE, loaded and stored through the same TMA), so each
K/V block is read once per K/V head. With `num_splits` above 1 each tile's K blocks are shared by
that many CTAs (a grid of tiles x splits), which write fp32 partial O and LSE from registers for the
combine kernel (combine.py); a split may have no block, and writes O 0 and LSE -inf. With
`combine_in_kernel` there is no combine kernel: a split CTA counts itself in at its tile's counter
once its partials are visible, and the tile's last CTA merges them (combine_last) and stores O and
LSE through the unsplit kernel's epilogue.

Ragged inputs (`layout`, flash-attn-4's varlen and paged calls; docs/serving.md) are compile-time:
packed Q, O, K and V and the pages of a paged cache go through TMA descriptors of a ragged view
(sm90/ragged.py) that bound every sequence at its own end, so O keeps its TMA store and K/V rows
past a sequence's keys load as zeros. A paged K/V block is one TMA box per page (or of a page), its
page ids loaded one per lane of the producer warp. With packed Q the CTAs are numbered over the
sequences' m blocks and each warp finds its tile's sequence by a prefix sum (varlen_tile). Ragged
kernels take one tile per CTA; a batch-shaped kernel compiles as it did before them.

The device methods pass their arguments grouped, in the frozen dataclasses of arguments.py (TMA
loads, output stores, shared tiles, pipelines, tiled MMAs, tile schedule, tile info, a warpgroup's
fragments); the pipeline states, which the dynamic loops carry, travel on their own.
"""

from __future__ import annotations

import math
from dataclasses import replace

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as hopper
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup

from ...problem import InputLayout, Problem
from ...target import Target, get_target
from ..sm90.helpers import (
    acc_as_operand_a,
    acc_rows_cols,
    convert_to_16bit,
    fetch_from_counter,
    pack_rows,
    permute_modes,
    smem_tile_layout,
    stages_as_rows,
    swap_first_modes,
    tma_pipeline,
    wgmma,
)
from ..sm90.ragged import flatten_rows, ragged_rows, sequence_rows, warp_prefix_sum
from ..sm90.softmax import OnlineSoftmax
from . import FAMILY, resources
from .arguments import (
    KvSource,
    OutputStores,
    Pipelines,
    Sequences,
    SharedTensors,
    TiledMmas,
    TileInfo,
    TileSchedule,
    TmaLoads,
    WgFragments,
)
from .config import FwdConfig

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}

# Named barrier ids; 0 is __syncthreads. A warp that only arrives at a barrier may run on to that
# barrier's next use before the waiting warps have left it, and its second arrival would then count
# toward the first: the epilogue's two handoffs have an id each (with one id, the fast warps of a
# persistent CTA could reach the next tile's O handoff early on a tile without keys). The turn
# barriers are safe: a warpgroup passes the turn on only after it has waited for it.
BARRIER_EPILOGUE = 1  # all consumers: O's buffer is free
BARRIER_TURN_FIRST = 2  # one per consumer warpgroup: 2, 3, 4
BARRIER_O_WRITTEN = 5  # consumers arrive, the storing warp waits: O is in shared memory
# The tile-number handoff of a counter-scheduled CTA (producer warp and consumers): the producer
# waits on EMPTY before it writes the next tile's number and arrives on FULL; the consumers wait on
# FULL, read, and arrive on EMPTY (once up front, then after every number but the last).
BARRIER_TILE_FULL = 6
BARRIER_TILE_EMPTY = 7
# With `wg_epilogue` each consumer warpgroup has its own pair: its O rows' buffer is free
# (8, 9, 10), and its O rows are in shared memory (11, 12, 13).
BARRIER_WG_O_FREE_FIRST = 8
BARRIER_WG_O_WRITTEN_FIRST = 11
# Four consumer warpgroups (tile_m 256, never with `wg_epilogue`) take their turns on 8-11: 2-4 and
# 5 would leave the fourth on the O handoff's id.
BARRIER_TURN_FIRST_4WG = 8
# The in-kernel combine's handoffs (every consumer thread waits at each): the partials are written,
# then whether this CTA is its tile's last split is in shared memory. Split kernels store no O
# through shared memory, so the epilogue's id is free until the last CTA's own epilogue (which
# waits at it too: every use is a full barrier).
BARRIER_SPLIT_COUNT = BARRIER_EPILOGUE


# The in-kernel combine (combine_last): rows of the MMA's accumulator layout per warp, and the
# constants of the combine kernel's exponentials (combine.py), the same so that its sums are.
WARP_ROWS = 16
LOG2_E = math.log2(math.e)
LN2 = math.log(2.0)


def warp_allreduce(value, op):
    """`op` over the warp's 32 values, every lane left with the result: the butterfly of the
    combine kernel (combine.py), in its order."""
    for offset in (16, 8, 4, 2, 1):
        value = op(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
    return value


class FlashForwardSm90:
    """Compile-time config of one forward kernel. Shapes (batch, seqlens, heads) are run-time."""

    def __init__(
        self,
        config: FwdConfig,
        dtype: str,
        head_dim: int,
        head_dim_v: int,
        causal: bool,
        target: Target | str | None = "H200",
        pack_group: int = 1,
        layout: InputLayout | None = None,
    ):
        target = get_target(target)
        layout = layout or InputLayout()
        # The same feasibility rules the search applies: refuse before any compile, naming the knob.
        # Packed GQA compiles its group size in, ragged inputs their layout; the problem stands for
        # any with that group and layout.
        FAMILY.check(
            Problem(
                dtype=dtype,
                head_dim=head_dim,
                head_dim_v=head_dim_v,
                causal=causal,
                nheads_q=pack_group,
                nheads_kv=1,
                **layout.stand_in(),
            ),
            config,
            target,
        )
        if pack_group > 1 and not config.pack_gqa:
            raise ValueError("pack_group above 1 needs a config with pack_gqa")
        self.config = config
        self.dtype = DTYPES[Problem(dtype=dtype, head_dim=head_dim).dtype]
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n
        self.num_stages = config.num_stages
        self.num_consumer_wg = resources.num_consumer_warpgroups(config)
        self.num_consumer_threads = resources.THREADS_PER_WARPGROUP * self.num_consumer_wg
        self.num_threads = resources.num_threads(config)
        self.producer_regs, self.consumer_regs = resources.register_split(config, layout)
        self.merge_unroll = resources.merge_splits_in_flight(  # combine_last
            config, head_dim_v, layout
        )
        self.intra_wg_overlap = config.intra_wg_overlap
        self.wg_pingpong = config.wg_pingpong
        self.rescale_threshold = config.rescale_threshold
        self.emu_share = config.emu_share
        self.poly_degree = config.poly_degree
        self.rescale_branch = config.rescale_branch
        self.persistent = config.persistent
        self.wg_epilogue = config.wg_epilogue
        self.q_stages = config.q_stages
        self.lazy_max = config.lazy_max
        # Persistent causal CTAs take their tiles from a global counter (see the module docstring).
        self.tile_counter = config.uses_tile_counter(causal)
        self.num_sms = target.sm_count
        # Packed GQA: a tile's rows are (query head in the group, query), the head fastest.
        self.pack_group = pack_group if config.pack_gqa else 1
        # Split-KV: O and LSE are fp32 partials with a split mode, merged by the combine kernel.
        self.split = config.split
        # ...and with combine_in_kernel merged by the tile's last split CTA (combine_last).
        self.combine_in_kernel = config.combine_in_kernel
        # Ragged inputs (flash-attn-4's varlen and paged calls): how q, k and v hold the batch.
        self.layout = layout
        # A paged K/V block is loaded as boxes of kv_box_rows rows, one page (or one tile of a page)
        # each.
        self.kv_box_rows = min(layout.page_size, config.tile_n) if layout.paged else config.tile_n

    # --------------------------------------------------------------------------------------------
    # Host side
    # --------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (batch, seqlen_q, nheads_q, head_dim)
        mK: cute.Tensor,  # (batch, seqlen_k, nheads_kv, head_dim)
        mV: cute.Tensor,  # (batch, seqlen_k, nheads_kv, head_dim_v)
        # (batch, seqlen_q, nheads_q, head_dim_v); split: fp32 (splits, batch, seqlen_q, ...)
        mO: cute.Tensor,
        # (batch, nheads_q, seqlen_q), float32; split: (splits, batch, nheads_q, seqlen_q)
        mLSE: cute.Tensor,
        mTileCounter: cute.Tensor,  # (1,) int32, zero between launches; for counter-scheduled CTAs
        softmax_scale_log2: Float32,
        heads_per_l2_group: Int32,
        stream: cuda.CUstream,
        # Ragged inputs (each None unless the layout has it), int32, as flash-attn-4 takes them:
        mCuSeqlensQ: cute.Tensor | None = None,  # (batch + 1,); q, O (total_q, heads, d)
        mCuSeqlensK: cute.Tensor | None = None,  # (batch + 1,); k, v (total_k, heads_kv, d)
        mSeqUsedK: cute.Tensor | None = None,  # (batch,)
        mPageTable: cute.Tensor | None = None,  # (batch, max_pages); k, v (pages, page_size, ...)
        # combine_in_kernel: O (batch, seqlen_q, nheads_q, head_dim_v) and LSE (batch, nheads_q,
        # seqlen_q) that the last split CTA of each tile writes; mO and mLSE are the partials and
        # mTileCounter the tiles' split counts, (batch x heads x m blocks,) int32 at zero.
        mOFinal: cute.Tensor | None = None,
        mLSEFinal: cute.Tensor | None = None,
    ):
        # Seqlen-major views: (seqlen, dim, head, batch) and (seqlen, head, batch) for LSE; the
        # split partials keep their split mode last. Packed (varlen) Q and O are (rows, dim, head,
        # ends) instead (sm90/ragged.py), and their LSE (rows, head); so are packed, paged and
        # seqused K and V. Varlen split partials are one batch of all rows: (splits, 1, total_q,
        # ...).
        total_q = num_batch = None
        if const_expr(self.layout.varlen_q):
            total_q, num_batch = mQ.shape[0], mCuSeqlensQ.shape[0] - 1
            mQ = ragged_rows(permute_modes(mQ, [0, 2, 1]))
        else:
            mQ = permute_modes(mQ, [1, 3, 2, 0])
        kv_batch_rows = None
        if const_expr(self.layout.varlen_k):
            mK, mV = [ragged_rows(permute_modes(t, [0, 2, 1])) for t in (mK, mV)]
        elif const_expr(self.layout.kv_rows):
            # Pages, or batch-shaped K and V with seqused_k: whole pages (batches) of rows.
            if const_expr(not self.layout.paged):
                kv_batch_rows = mK.shape[1]
            mK, mV = [ragged_rows(flatten_rows(t)) for t in (mK, mV)]
        else:
            mK, mV = [permute_modes(t, [1, 3, 2, 0]) for t in (mK, mV)]
        if const_expr(self.split):
            mO = permute_modes(mO, [2, 4, 3, 1, 0])
            mLSE = permute_modes(mLSE, [3, 2, 1, 0])
        elif const_expr(self.layout.varlen_q):
            mO = ragged_rows(permute_modes(mO, [0, 2, 1]))
            mLSE = permute_modes(mLSE, [1, 0])
        else:
            mO = permute_modes(mO, [1, 3, 2, 0])
            mLSE = permute_modes(mLSE, [2, 1, 0])
        if const_expr(self.combine_in_kernel):
            mOFinal = permute_modes(mOFinal, [1, 3, 2, 0])
            mLSEFinal = permute_modes(mLSEFinal, [2, 1, 0])
        if const_expr(self.pack_group > 1):
            # Rows (query head in the group, query) of each K/V head: mode 0 becomes (group,
            # seqlen), and the heads mode counts K/V heads.
            mQ, mO = pack_rows(mQ, self.pack_group, 2), pack_rows(mO, self.pack_group, 2)
            mLSE = pack_rows(mLSE, self.pack_group, 1)
            if const_expr(self.combine_in_kernel):
                mOFinal = pack_rows(mOFinal, self.pack_group, 2)
                mLSEFinal = pack_rows(mLSEFinal, self.pack_group, 1)

        tile_m, tile_n, d, dv = self.tile_m, self.tile_n, self.head_dim, self.head_dim_v
        mma_qk = hopper.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(self.num_consumer_wg, 1, 1),
            tiler_mn=(64, tile_n),
        )
        mma_pv = hopper.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(self.num_consumer_wg, 1, 1),
            tiler_mn=(64, dv),
            a_source=warpgroup.OperandSource.RMEM,
        )
        # With q_stages 2 (persistent only) Q has a stage mode: the next tile's Q loads into the
        # other buffer while this tile's S GEMMs still read theirs.
        sQ_layout = smem_tile_layout(
            self.dtype, tile_m, d, self.q_stages if self.q_stages > 1 else None
        )
        sQ_one = sQ_layout if self.q_stages == 1 else cute.select(sQ_layout, mode=[0, 1])
        sK_layout = smem_tile_layout(self.dtype, tile_n, d, self.num_stages)
        sV_layout = smem_tile_layout(self.dtype, tile_n, dv, self.num_stages)
        sO_layout = smem_tile_layout(self.dtype, tile_m, dv)
        sO_box, o_box = sO_layout, (tile_m, dv)
        if const_expr(self.wg_epilogue):
            # One (64, dv) buffer per consumer warpgroup, each stored by its own TMA store.
            sO_layout = smem_tile_layout(self.dtype, 64, dv, self.num_consumer_wg)
            sO_box, o_box = cute.select(sO_layout, mode=[0, 1]), (64, dv)

        # Single tile: O is staged in Q's buffer (Q is dead once every consumer has issued its last
        # S GEMM). Persistent: the next tile's Q loads while this tile's O is stored, so O has its
        # own.
        q_o_elems = max(cute.cosize(sQ_layout), cute.cosize(sO_layout))
        o_elems = 0
        if const_expr(self.persistent):
            q_o_elems = cute.cosize(sQ_layout)
            o_elems = cute.cosize(sO_layout)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * self.num_stages]
            if const_expr(self.tile_counter):  # in the barrier region, where resources books it
                tile_slot: cute.struct.MemRange[Int32, 2]
            if const_expr(
                self.combine_in_kernel
            ):  # in the barrier region, where resources books it
                last_slot: cute.struct.MemRange[Int32, 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, q_o_elems], resources.SMEM_ALIGN]
            sK: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], resources.SMEM_ALIGN
            ]
            sV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], resources.SMEM_ALIGN
            ]
            if const_expr(self.persistent):
                sO: cute.struct.Align[
                    cute.struct.MemRange[self.dtype, o_elems], resources.SMEM_ALIGN
                ]

        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(load, mQ, sQ_one, (tile_m, d))
        # A K/V block is one TMA box, or with pages smaller than the tile one box per page.
        box = self.kv_box_rows
        sK_box = cute.select(sK_layout, mode=[0, 1])
        if const_expr(box < tile_n):
            sK_box = smem_tile_layout(self.dtype, box, d)
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(load, mK, sK_box, (box, d))
        sV_box = cute.select(sV_layout, mode=[0, 1])
        if const_expr(box < tile_n):
            sV_box = smem_tile_layout(self.dtype, box, dv)
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(load, mV, sV_box, (box, dv))
        tma_o_final = tma_mO_final = None
        if const_expr(self.combine_in_kernel):
            # The last split CTA stores the merged O as the unsplit kernel does (epilogue).
            tma_o_final, tma_mO_final = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mOFinal, sO_box, o_box
            )
        if const_expr(self.split):
            # The fp32 partials are stored from registers: no TMA store. Q's atom fills O's slot
            # of the kernel's parameters (and is not used there).
            tma_o, tma_mO = tma_q, mO
        else:
            tma_o, tma_mO = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, sO_box, o_box
            )
        bytes_q = cute.size_in_bytes(self.dtype, sQ_one)
        bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))

        num_m_blocks = cute.ceil_div(cute.size(mQ.shape[0]), tile_m)
        if const_expr(self.layout.varlen_q):
            # Tiles numbered over the sequences' m blocks (varlen_tile), x heads; the sum of
            # ceil(rows / tile_m) over the batch is at most this bound, the rest of the grid idles.
            rows = total_q * self.pack_group
            bound = (rows + num_batch * (tile_m - 1)) // tile_m
            splits = cute.size(mLSE, mode=[3]) if const_expr(self.split) else 1
            grid = [bound * cute.size(mQ.shape[2]), splits, 1]
        elif const_expr(self.split):
            # One CTA per (tile, split); the splits of a tile are adjacent.
            grid = [
                num_m_blocks * cute.size(mLSE, mode=[3]),
                cute.size(mQ.shape[2]),
                cute.size(mQ.shape[3]),
            ]
        elif const_expr(self.persistent):
            # One CTA per SM (the register split allows no more), each walking the tiles with stride
            # grid. The SM count is the compile target's: on a GPU with fewer SMs the surplus CTAs
            # run as a second wave, right but slower.
            num_tiles = num_m_blocks * cute.size(mQ.shape[2]) * cute.size(mQ.shape[3])
            grid = [cutlass.min(num_tiles, self.num_sms), 1, 1]
        elif const_expr(self.causal):
            # One flat index, decoded longest-first in tile_coords.
            grid = [num_m_blocks * cute.size(mQ.shape[2]) * cute.size(mQ.shape[3]), 1, 1]
        else:
            # All m blocks of a head are adjacent, so their shared K/V is read once into L2.
            grid = [num_m_blocks, cute.size(mQ.shape[2]), cute.size(mQ.shape[3])]
        self.kernel(
            tma_mQ,
            tma_mK,
            tma_mV,
            tma_mO,
            mLSE,
            mTileCounter,
            tma_q,
            tma_k,
            tma_v,
            tma_o,
            sQ_layout,
            sK_layout,
            sV_layout,
            sO_layout,
            mma_qk,
            mma_pv,
            softmax_scale_log2,
            heads_per_l2_group,
            bytes_q,
            bytes_k,
            bytes_v,
            SharedStorage,
            mCuSeqlensQ,
            mCuSeqlensK,
            mSeqUsedK,
            mPageTable,
            kv_batch_rows,
            tma_o_final,
            tma_mO_final,
            mLSEFinal,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    # --------------------------------------------------------------------------------------------
    # Device side
    # --------------------------------------------------------------------------------------------
    @cute.jit
    def tile_coords(self, sched: TileSchedule, tile: Int32):
        """(m_block, head, batch) of tile number `tile` (a persistent CTA's current tile, or this
        CTA's block index).

        Non-causal tiles all cost the same: m blocks run fastest, then heads, then batches, so the
        m blocks of one head, which share its K/V, run side by side. Causal tiles are scheduled
        longest first (last rows first) and grouped by `heads_per_l2_group` heads whose K/V fit in
        L2 together; inside a group the head index runs fastest."""
        mQ, heads_per_l2_group = sched.mQ, sched.heads_per_l2_group
        seqlen_q = self.rows(mQ)
        nheads = mQ.shape[2]
        num_m = (seqlen_q + self.tile_m - 1) // self.tile_m
        m_block = tile
        bh = tile
        split = None
        if const_expr(self.split):
            # (m block, split) fastest, then heads, then batches: the grid's x, y, z.
            span = num_m * sched.num_splits
            bh = tile // span
            within = tile - bh * span
            split = within // num_m
            m_block = within - split * num_m
        elif const_expr(not self.causal):
            bh = tile // num_m
            m_block = tile - bh * num_m
        else:
            num_bh = nheads * mQ.shape[3]
            group_span = heads_per_l2_group * num_m
            group = tile // group_span
            within = tile - group * group_span
            heads_here = cutlass.min(heads_per_l2_group, num_bh - group * heads_per_l2_group)
            m_idx = within // heads_here
            bh = group * heads_per_l2_group + (within - m_idx * heads_here)
            m_block = num_m - 1 - m_idx
        batch = bh // nheads
        head = bh - batch * nheads
        return m_block, head, batch, split

    @cute.jit
    def varlen_tile(self, sched: TileSchedule, tile: Int32):
        """(m_block, head, batch, split) of tile number `tile` with varlen Q: the tiles of batch 0
        (its m blocks x heads, a head's m blocks adjacent so that they share its K/V in L2; causal:
        the last m block, the longest, first), then those of batch 1, and so on. Each warp finds
        the batch on its own: its lanes count the m blocks of 32 batches at a time and a prefix sum
        says whose range holds the tile. A tile past the last batch's (the grid is a bound) gets
        batch = the batch count, which sequence() gives no rows and no keys."""
        cu = sched.seqs.cu_seqlens_q
        num_batch = cu.shape[0] - 1
        heads = sched.mQ.shape[2]
        lane = cute.arch.lane_idx()
        split = None
        if const_expr(self.split):
            split = cute.arch.block_idx()[1]
        first = Int32(0)  # the first batch of the 32 the lanes count
        before = Int32(0)  # the tiles of the batches before it
        blocks, ends, total = self.batch_tiles(cu, first + lane, num_batch, heads, lane)
        more = first + 32 < num_batch
        while before + total <= tile and more:
            before = before + total
            first = first + 32
            blocks, ends, total = self.batch_tiles(cu, first + lane, num_batch, heads, lane)
            more = first + 32 < num_batch
        # The lanes whose batches end at or before the tile: the tile is in the next one's.
        passed = cute.arch.popc(cute.arch.vote_ballot_sync(before + ends <= tile))
        owner = cutlass.min(passed, 31)
        start = before + cute.arch.shuffle_sync(ends - blocks * heads, owner)
        num_m = cutlass.max(cute.arch.shuffle_sync(blocks, owner), 1)
        within = tile - start
        head = within // num_m
        m_block = within - head * num_m
        if const_expr(self.causal):
            m_block = num_m - 1 - m_block
        batch = first + passed
        batch = batch if passed < 32 else num_batch
        return m_block, head, cutlass.min(batch, num_batch), split

    @cute.jit
    def batch_tiles(self, cu: cute.Tensor, batch: Int32, num_batch: Int32, heads, lane: Int32):
        """For lane `lane` counting batch `batch`: (its m blocks, the tiles of the lanes up to it
        inclusive, the tiles of all 32 lanes)."""
        blocks = Int32(0)
        if batch < num_batch:
            rows = (cu[batch + 1] - cu[batch]) * self.pack_group
            blocks = (rows + self.tile_m - 1) // self.tile_m
        ends = warp_prefix_sum(blocks * heads, lane)
        return blocks, ends, cute.arch.shuffle_sync(ends, 31)

    @cute.jit
    def sequence(self, sched: TileSchedule, batch: Int32, kv_seqlen: Int32):
        """(offset_q, seqlen_q, offset_k, seqlen_k) of batch `batch` with ragged inputs: offsets
        are None for batch-shaped tensors; `kv_seqlen` is the keys of batch-shaped or paged K and V
        without seqused_k. A batch past the last (varlen_tile's) has no queries and no keys."""
        seqs = sched.seqs
        offset_q = offset_k = None
        seqlen_q = self.queries(sched.mQ)
        seqlen_k = kv_seqlen
        last = Int32(0)
        if const_expr(self.layout.varlen_q):
            last = seqs.cu_seqlens_q.shape[0] - 2
            b = cutlass.min(batch, last)
            offset_q = seqs.cu_seqlens_q[b]
            seqlen_q = seqs.cu_seqlens_q[b + 1] - offset_q
        if const_expr(self.layout.varlen_k):
            b = cutlass.min(batch, seqs.cu_seqlens_k.shape[0] - 2)
            offset_k = seqs.cu_seqlens_k[b]
            seqlen_k = seqs.cu_seqlens_k[b + 1] - offset_k
        elif const_expr(self.layout.kv_rows and not self.layout.paged):
            offset_k = batch * seqs.kv_batch_rows
        if const_expr(self.layout.seqused_k):
            seqlen_k = seqs.seqused_k[cutlass.min(batch, seqs.seqused_k.shape[0] - 1)]
        if const_expr(self.layout.varlen_q):
            seqlen_q = seqlen_q if batch <= last else 0
            seqlen_k = seqlen_k if batch <= last else 0
        return offset_q, seqlen_q, offset_k, seqlen_k

    @cute.jit
    def ragged_tile_info(self, sched: TileSchedule, tile: Int32, kv_seqlen: Int32) -> TileInfo:
        """The TileInfo of tile number `tile` with ragged inputs: its coordinates (varlen_tile with
        varlen Q, else tile_coords), its batch's sequences, and its K blocks."""
        if const_expr(self.layout.varlen_q):
            m_block, head, batch, split = self.varlen_tile(sched, tile)
        else:
            m_block, head, batch, split = self.tile_coords(sched, tile)
        offset_q, seqlen_q, offset_k, seqlen_k = self.sequence(sched, batch, kv_seqlen)
        n_block_min, n_block_max, n_mask_min = self.n_block_range(
            m_block, seqlen_q, seqlen_k, split, sched.num_splits
        )
        return TileInfo(
            m_block,
            head,
            batch,
            seqlen_q,
            seqlen_k,
            n_block_max,
            n_mask_min,
            seqlen_q * self.pack_group,
            n_block_min,
            split,
            offset_q,
            offset_k,
        )

    def rows(self, mQ: cute.Tensor):
        """Rows of Q per head and batch: seqlen_q, or with packed GQA group x seqlen_q."""
        if const_expr(self.pack_group > 1):
            return cute.size(mQ, mode=[0])
        return mQ.shape[0]

    def queries(self, mQ: cute.Tensor):
        """seqlen_q (the causal diagonal's offset is seqlen_k - seqlen_q)."""
        if const_expr(self.pack_group > 1):
            return mQ.shape[0][1]
        return mQ.shape[0]

    def row_query(self, row):
        """The query of a tile row: the row itself, or with packed GQA row // group."""
        if const_expr(self.pack_group > 1):
            return row // self.pack_group
        return row

    def later_blocks(self, info: TileInfo):
        """How many K blocks the tile's CTA visits after its first."""
        if const_expr(self.split):
            return info.n_block_max - info.n_block_min - 1
        return info.n_block_max - 1

    def block_count(self, info: TileInfo):
        """How many K blocks the tile's CTA visits: [n_block_min, n_block_max)."""
        if const_expr(self.split):
            return info.n_block_max - info.n_block_min
        return info.n_block_max

    def first_tile(self, sched: TileSchedule):
        """This CTA's first tile number and the number of tiles. A non-persistent CTA has one tile:
        its block index (the 3-D grid of non-causal runs flattened the way tile_coords reads it)."""
        mQ = sched.mQ
        bx, by, bz = cute.arch.block_idx()
        tile = bx
        if const_expr(self.layout.varlen_q):
            # One tile per CTA, numbered over the sequences (varlen_tile); the split is by.
            return tile, cute.arch.grid_dim()[0]
        if const_expr(not self.persistent and (not self.causal or self.split)):
            tile = bx + cute.arch.grid_dim()[0] * (by + mQ.shape[2] * bz)
        num_m = (self.rows(mQ) + self.tile_m - 1) // self.tile_m
        if const_expr(self.split):
            num_m = num_m * sched.num_splits
        return tile, num_m * mQ.shape[2] * mQ.shape[3]

    def next_tile(self, tile, num_tiles):
        """The tile after `tile` for a CTA without the counter (num_tiles or more when it has no
        more): persistent CTAs take one tile per round of grid-size tiles."""
        if const_expr(not self.persistent):
            return num_tiles
        return tile + cute.arch.grid_dim()[0]

    @property
    def tile_handoff_threads(self) -> int:
        return 32 + self.num_consumer_threads  # the producer warp and the consumers

    @cute.jit
    def n_block_range(
        self, m_block: Int32, seqlen_q: Int32, seqlen_k: Int32, split=None, num_splits=None
    ):
        """(n_block_min, n_block_max, n_mask_min): this CTA visits K blocks [n_block_min,
        n_block_max) of the Q tile (n_block_min None without split-KV: from 0); blocks
        [n_mask_min, n_block_max) need the causal mask. A split takes the split-th run of
        ceil(blocks / num_splits) blocks, and may have none."""
        n_block_max = (seqlen_k + self.tile_n - 1) // self.tile_n
        n_mask_min = n_block_max
        if const_expr(self.causal):
            # Bottom-right alignment: query i sees keys j < i + 1 + seqlen_k - seqlen_q. The tile's
            # last row bounds the visible blocks; its first row bounds the blocks that need no mask.
            if const_expr(self.pack_group > 1):
                last_row = self.row_query((m_block + 1) * self.tile_m - 1)
                last_row_end = last_row + 1 + seqlen_k - seqlen_q
            else:
                last_row_end = (m_block + 1) * self.tile_m + seqlen_k - seqlen_q
            n_block_max = cutlass.min(
                n_block_max, (cutlass.max(last_row_end, 0) + self.tile_n - 1) // self.tile_n
            )
            if const_expr(self.pack_group > 1):
                first_row = self.row_query(m_block * self.tile_m)
                first_row_end = first_row + seqlen_k - seqlen_q + 1
            else:
                first_row_end = m_block * self.tile_m + seqlen_k - seqlen_q + 1
            n_mask_min = cutlass.max(first_row_end, 0) // self.tile_n
        n_block_min = None
        if const_expr(self.split):
            per_split = (n_block_max + num_splits - 1) // num_splits
            n_block_min = split * per_split
            n_block_max = cutlass.min(n_block_max, n_block_min + per_split)
        return n_block_min, n_block_max, n_mask_min

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mTileCounter: cute.Tensor,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_o: cute.CopyAtom,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        mma_qk: cute.TiledMma,
        mma_pv: cute.TiledMma,
        softmax_scale_log2: Float32,
        heads_per_l2_group: Int32,
        bytes_q: cutlass.Constexpr[int],
        bytes_k: cutlass.Constexpr[int],
        bytes_v: cutlass.Constexpr[int],
        SharedStorage: cutlass.Constexpr,
        mCuSeqlensQ: cute.Tensor | None,
        mCuSeqlensK: cute.Tensor | None,
        mSeqUsedK: cute.Tensor | None,
        mPageTable: cute.Tensor | None,
        kv_batch_rows: Int32 | None,
        tma_o_final: cute.CopyAtom | None,
        mOFinal: cute.Tensor | None,
        mLSEFinal: cute.Tensor | None,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)
            if const_expr(self.combine_in_kernel):
                cpasync.prefetch_descriptor(tma_o_final)

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        warps = self.num_consumer_wg * 4  # each consumer warp arrives once to release a stage
        pipe_q = tma_pipeline(storage.mbar_q.data_ptr(), self.q_stages, bytes_q, warps)
        pipe_k = tma_pipeline(storage.mbar_k.data_ptr(), self.num_stages, bytes_k, warps)
        pipe_v = tma_pipeline(storage.mbar_v.data_ptr(), self.num_stages, bytes_v, warps)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()
        if const_expr(self.split and not self.combine_in_kernel):
            # The combine kernel is launched as this grid's programmatic dependent: once every CTA
            # has said so here, its CTAs start and wait (griddepcontrol.wait) for this grid to end,
            # so that its launch does not follow this grid's last CTA (combine.py).
            cute.arch.griddepcontrol_launch_dependents()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if const_expr(self.persistent):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner, dtype=self.dtype)
        sTile = None
        if const_expr(self.tile_counter):
            sTile = storage.tile_slot.get_tensor(cute.make_layout(1))
        final = None
        if const_expr(self.combine_in_kernel):
            final = (
                OutputStores(tma_o_final, mOFinal, mLSEFinal),
                storage.last_slot.get_tensor(cute.make_layout(1)),
            )

        # The kernel keeps its parameters one by one, as the launch passes them (they are the PTX
        # entry's parameters, in this order, and the first ones name it); its methods take them
        # grouped (arguments.py).
        smem = SharedTensors(sQ, sK, sV, sO)
        pipes = Pipelines(pipe_q, pipe_k, pipe_v)
        num_splits = None
        if const_expr(self.split):
            num_splits = cute.size(mLSE, mode=[3])
        seqs = kv_seqlen = None
        if const_expr(self.layout.ragged):
            seqs = Sequences(mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mPageTable, kv_batch_rows)
            # The keys of every batch where they do not come per batch (sequence): batch-shaped K,
            # or every page of the table.
            kv_seqlen = mK.shape[0]
            if const_expr(self.layout.paged):
                kv_seqlen = mPageTable.shape[1] * self.layout.page_size
        sched = TileSchedule(mQ, heads_per_l2_group, mTileCounter, sTile, num_splits, seqs)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.produce(
                    TmaLoads(tma_q, tma_k, tma_v, mQ, mK, mV, mPageTable),
                    smem,
                    pipes,
                    sched,
                    kv_seqlen,
                )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(
                OutputStores(tma_o, mO, mLSE),
                smem,
                TiledMmas(mma_qk, mma_pv),
                pipes,
                sched,
                softmax_scale_log2,
                mK.shape[0] if const_expr(kv_seqlen is None) else kv_seqlen,
                tidx - 128,
                final,
            )

    # ---- producer ------------------------------------------------------------------------------
    @cute.jit
    def produce(
        self,
        loads: TmaLoads,
        smem: SharedTensors,
        pipes: Pipelines,
        sched: TileSchedule,
        kv_seqlen: Int32,
    ):
        """Load Q and the visible K/V blocks of each of this CTA's tiles. The stage sequence runs on
        across tiles: a persistent CTA fills the next tile's stages as soon as they free up.
        `kv_seqlen`: the keys of a batch when they do not come per batch (ragged_tile_info)."""
        mQ, mK = loads.mQ, loads.mK
        # A name of its own: the tile number is written through it inside the loop, and the DSL
        # carries a name written there through the loop (written through `sched`, the whole group).
        sTile = sched.slot
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        tile, num_tiles = self.first_tile(sched)
        while tile < num_tiles:
            if const_expr(self.layout.ragged):
                info = self.ragged_tile_info(sched, tile, kv_seqlen)
                head_kv = info.head // (mQ.shape[2] // mK.shape[2])
            else:
                m_block, head, batch, split = self.tile_coords(sched, tile)
                head_kv = head // (mQ.shape[2] // mK.shape[2])
                seqlen_q, seqlen_k = self.queries(mQ), mK.shape[0]
                n_block_min, n_block_max, n_mask_min = self.n_block_range(
                    m_block, seqlen_q, seqlen_k, split, sched.num_splits
                )
                info = TileInfo(
                    m_block,
                    head,
                    batch,
                    seqlen_q,
                    seqlen_k,
                    n_block_max,
                    n_mask_min,
                    self.rows(mQ),
                    n_block_min,
                    split,
                )
            if self.block_count(info) > 0:
                kv_state, q_state = self.produce_tile(
                    loads, smem, pipes, info, head_kv, kv_state, q_state
                )
            if const_expr(self.tile_counter):
                tile = fetch_from_counter(sched.counter, num_tiles)
                cute.arch.barrier(
                    barrier_id=BARRIER_TILE_EMPTY, number_of_threads=self.tile_handoff_threads
                )
                sTile[0] = tile
                cute.arch.barrier_arrive(
                    barrier_id=BARRIER_TILE_FULL, number_of_threads=self.tile_handoff_threads
                )
            else:
                tile = self.next_tile(tile, num_tiles)

    @cute.jit
    def produce_tile(
        self,
        loads: TmaLoads,
        smem: SharedTensors,
        pipes: Pipelines,
        info: TileInfo,
        head_kv: Int32,
        kv_state: pipeline.PipelineState,
        q_state: pipeline.PipelineState,
    ):
        """Load one tile's Q and its K/V blocks, last block first; returns the pipeline states for
        the next tile."""
        m_block, head, batch, n_block_max = info.m_block, info.head, info.batch, info.n_block_max
        n_block_last = 0  # the last block visited
        if const_expr(self.split):
            n_block_last = info.n_block_min
        if const_expr(self.layout.ragged):
            one_cta = cute.make_layout(1)
            mQ_tile = loads.mQ[None, None, head, batch]
            if const_expr(self.layout.varlen_q):
                mQ_tile = sequence_rows(
                    loads.mQ[None, None, head, None],
                    info.offset_q,
                    info.seqlen_q,
                    self.pack_group > 1,
                )
            gQ = cute.local_tile(mQ_tile, (self.tile_m, self.head_dim), (m_block, 0))
            tQsQ, tQgQ = cpasync.tma_partition(
                loads.tma_q, 0, one_cta, cute.group_modes(smem.sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            k_src = self.kv_source(
                loads.tma_k, pipes.k, loads.mK, smem.sK, head_kv, info, loads.page_table
            )
            v_src = self.kv_source(
                loads.tma_v, pipes.v, loads.mV, smem.sV, head_kv, info, loads.page_table
            )
        else:
            gQ = cute.local_tile(
                loads.mQ[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0)
            )
            gK = cute.local_tile(
                loads.mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0)
            )
            gV = cute.local_tile(
                loads.mV[None, None, head_kv, batch], (self.tile_n, self.head_dim_v), (None, 0)
            )
            one_cta = cute.make_layout(1)
            tQsQ, tQgQ = cpasync.tma_partition(
                loads.tma_q, 0, one_cta, cute.group_modes(smem.sQ, 0, 2), cute.group_modes(gQ, 0, 2)
            )
            tKsK, tKgK = cpasync.tma_partition(
                loads.tma_k, 0, one_cta, cute.group_modes(smem.sK, 0, 2), cute.group_modes(gK, 0, 2)
            )
            tVsV, tVgV = cpasync.tma_partition(
                loads.tma_v, 0, one_cta, cute.group_modes(smem.sV, 0, 2), cute.group_modes(gV, 0, 2)
            )
            k_src = KvSource(loads.tma_k, pipes.k, tKsK, tKgK)
            v_src = KvSource(loads.tma_v, pipes.v, tVsV, tVgV)

        # K of the first block goes first: the first S GEMM needs it together with Q.
        self.load_stage(k_src, n_block_max - 1, kv_state, info)
        pipes.q.producer_acquire(q_state)
        if const_expr(self.q_stages > 1):
            tQsQ = tQsQ[None, q_state.index]
        cute.copy(loads.tma_q, tQgQ, tQsQ, tma_bar_ptr=pipes.q.producer_get_barrier(q_state))
        q_state.advance()
        if const_expr(self.intra_wg_overlap):
            # Consumers need K(j+1) before V(j): S GEMMs run one step ahead of PV GEMMs.
            for i in cutlass.range(self.later_blocks(info), unroll=1):
                n_block = n_block_max - 2 - i
                v_state = kv_state.clone()
                kv_state.advance()
                self.load_stage(k_src, n_block, kv_state, info)
                self.load_stage(v_src, n_block + 1, v_state, info)
            self.load_stage(v_src, n_block_last, kv_state, info)
        else:
            self.load_stage(v_src, n_block_max - 1, kv_state, info)
            for i in cutlass.range(self.later_blocks(info), unroll=1):
                n_block = n_block_max - 2 - i
                kv_state.advance()
                self.load_stage(k_src, n_block, kv_state, info)
                self.load_stage(v_src, n_block, kv_state, info)
        kv_state.advance()  # the next tile starts on the next stage
        return kv_state, q_state

    def kv_source(self, tma, pipe, mX, sX, head_kv, info: TileInfo, page_table) -> KvSource:
        """K or V of one tile with ragged inputs: the batch's packed rows (varlen, or batch-shaped
        with seqused_k), bounded at its keys, in blocks; batch-shaped K and V (under varlen Q) as
        ever; or, paged, the K/V head's rows view whose pages load_page_box finds through the page
        table."""
        dim = cute.size(sX, mode=[1])
        one_cta = cute.make_layout(1)
        if const_expr(self.layout.paged):
            # A stage as boxes of kv_box_rows rows: (box rows, dim, boxes, 1, stages).
            boxes = cute.flat_divide(sX, (self.kv_box_rows, dim))
            one_box = cute.local_tile(mX[None, None, head_kv, 0], (self.kv_box_rows, dim), (0, 0))
            tXsX, _ = cpasync.tma_partition(
                tma, 0, one_cta, cute.group_modes(boxes, 0, 2), cute.group_modes(one_box, 0, 2)
            )
            return KvSource(
                tma,
                pipe,
                tXsX,
                mX[None, None, head_kv, None],
                box=cute.group_modes(boxes[None, None, 0, 0, 0], 0, 2),
                page_table=page_table,
                dim=dim,
            )
        rows = mX[None, None, head_kv, info.batch]  # batch-shaped (with varlen Q)
        if const_expr(self.layout.kv_rows):
            rows = sequence_rows(mX[None, None, head_kv, None], info.offset_k, info.seqlen_k)
        gX = cute.local_tile(rows, (self.tile_n, dim), (None, 0))
        tXsX, tXgX = cpasync.tma_partition(
            tma, 0, one_cta, cute.group_modes(sX, 0, 2), cute.group_modes(gX, 0, 2)
        )
        return KvSource(tma, pipe, tXsX, tXgX)

    def load_stage(self, src: KvSource, n_block, state, info: TileInfo):
        """Wait for the stage to be free, then TMA one K or V block into it (paged: a box per page
        or tile of a page)."""
        src.pipe.producer_acquire(state)
        if const_expr(self.layout.paged):
            page = self.block_pages(src, n_block, info)
            for box in range(self.tile_n // self.kv_box_rows):  # unrolled at trace time
                self.load_page_box(src, n_block, box, page, state, info)
        else:
            cute.copy(
                src.tma,
                src.gmem[None, n_block],
                src.smem[None, state.index],
                tma_bar_ptr=src.pipe.producer_get_barrier(state),
            )

    @cute.jit
    def block_pages(self, src: KvSource, n_block, info: TileInfo):
        """The page ids of K/V block `n_block`'s boxes, lane b of the producer warp holding box
        b's: one load per lane, all in flight together (a box past the table reads its last id,
        which its box then never follows)."""
        boxes = self.tile_n // self.kv_box_rows
        lane = cute.arch.lane_idx()
        table = src.page_table
        box = cutlass.min(lane, boxes - 1)
        page_idx = (n_block * self.tile_n + box * self.kv_box_rows) // self.layout.page_size
        return table[info.batch, cutlass.min(page_idx, table.shape[1] - 1)]

    @cute.jit
    def load_page_box(self, src: KvSource, n_block, box: int, page, state, info: TileInfo):
        """Box `box` of K/V block `n_block` of a paged cache: kv_box_rows keys of one page, whose
        id lane `box` holds in `page` (block_pages). The box's rows past the batch's keys (past the
        used part of its page) read as zeros. A box wholly past them loads the block's last box
        with keys again instead: a TMA box out of bounds in every row faulted on the H200
        (docs/kernel-notes.md, session 36), and the copy is finite and masked like any key past
        the end, so a page id past the used pages is never followed."""
        page_size, rows = self.layout.page_size, self.kv_box_rows
        from_box = box
        if const_expr(self.tile_n > rows):  # boxes past the keys exist only with several
            from_box = cutlass.min(box, (info.seqlen_k - 1 - n_block * self.tile_n) // rows)
        key0 = n_block * self.tile_n + from_box * rows
        page_idx = key0 // page_size
        page_start = page_idx * page_size
        used = cutlass.max(cutlass.min(info.seqlen_k - page_start, page_size), 0)
        page_id = cute.arch.shuffle_sync(page, from_box)
        view = sequence_rows(src.gmem, page_id * page_size, used)
        g = cute.local_tile(view, (rows, src.dim), ((key0 - page_start) // rows, 0))
        _, tXgX = cpasync.tma_partition(
            src.tma, 0, cute.make_layout(1), src.box, cute.group_modes(g, 0, 2)
        )
        cute.copy(
            src.tma,
            tXgX,
            src.smem[None, box, 0, state.index],
            tma_bar_ptr=src.pipe.producer_get_barrier(state),
        )

    # ---- consumers -----------------------------------------------------------------------------
    @property
    def turn_barrier_first(self) -> int:
        return BARRIER_TURN_FIRST_4WG if self.num_consumer_wg == 4 else BARRIER_TURN_FIRST

    def turn_wait(self, wg: Int32):
        if const_expr(self.wg_pingpong and self.num_consumer_wg > 1):
            cute.arch.barrier(barrier_id=self.turn_barrier_first + wg, number_of_threads=256)

    def turn_pass(self, wg: Int32):
        if const_expr(self.wg_pingpong and self.num_consumer_wg > 1):
            nxt = wg + 1
            if const_expr(self.num_consumer_wg == 2):
                nxt = 1 - wg
            else:
                nxt = nxt - (nxt // self.num_consumer_wg) * self.num_consumer_wg
            cute.arch.barrier_arrive(
                barrier_id=self.turn_barrier_first + nxt, number_of_threads=256
            )

    @cute.jit
    def mask_scores(
        self,
        acc_S: cute.Tensor,
        thr_mma_qk: cute.ThrMma,
        info: TileInfo,
        n_block: Int32,
        causal: cutlass.Constexpr[bool],
    ):
        """Set scores past seqlen_k (and, if causal, above the diagonal) to -inf."""
        m_block, seqlen_q, seqlen_k = info.m_block, info.seqlen_q, info.seqlen_k
        scores = acc_rows_cols(acc_S)
        coords = acc_rows_cols(
            thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        )
        # Columns of thread 0 are compile-time constants; shift the limit by this thread's offset.
        coords0 = acc_rows_cols(
            thr_mma_qk.get_slice(0).partition_C(
                cute.make_identity_tensor((self.tile_m, self.tile_n))
            )
        )
        col_offset = coords[0, 0][1]
        col_limit_k = seqlen_k - n_block * self.tile_n - col_offset
        for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
            limit = col_limit_k
            if const_expr(causal):
                row = self.row_query(m_block * self.tile_m + coords[r, 0][0])
                limit = cutlass.min(
                    limit, row + 1 + seqlen_k - seqlen_q - n_block * self.tile_n - col_offset
                )
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                # A select per element: an `if` here would carry the whole fragment through each
                # branch.
                scores[r, c] = -Float32.inf if coords0[0, c][1] >= limit else scores[r, c]

    @cute.jit
    def consume(
        self,
        stores: OutputStores,
        smem: SharedTensors,
        mmas: TiledMmas,
        pipes: Pipelines,
        sched: TileSchedule,
        softmax_scale_log2: Float32,
        seqlen_k: Int32,
        ctid: Int32,
        final=None,
    ):
        """The main loop and epilogue of each of this CTA's tiles, for consumer thread `ctid`.
        `final` (combine_in_kernel): O's and LSE's stores and the shared last-split flag."""
        wg = cute.arch.make_warp_uniform(ctid // 128)
        wg_mma_qk = mmas.qk.get_slice(wg * 128)
        wg_mma_pv = mmas.pv.get_slice(wg * 128)
        thr_mma_qk = mmas.qk.get_slice(ctid)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(smem.sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(smem.sK))
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(swap_first_modes(smem.sV)))
        acc_O = cute.make_rmem_tensor(
            wg_mma_pv.partition_shape_C((self.tile_m, self.head_dim_v)), Float32
        )
        tOrP = wg_mma_pv.make_fragment_A(wg_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        s_shape = wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n))

        softmax = OnlineSoftmax(
            softmax_scale_log2,
            cute.size(acc_rows_cols(acc_O), mode=[0]),
            self.rescale_threshold,
            self.emu_share,
            self.poly_degree,
            self.rescale_branch,
        )
        row_scale = cute.make_rmem_tensor(softmax.num_rows, Float32)

        if const_expr(self.wg_pingpong and self.num_consumer_wg > 1):
            if wg == 0:  # the first warpgroup starts with its turn
                cute.arch.barrier_arrive(barrier_id=self.turn_barrier_first, number_of_threads=256)

        kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        seqlen_q = self.queries(sched.mQ)
        rows = self.rows(sched.mQ)
        tile, num_tiles = self.first_tile(sched)
        if const_expr(self.tile_counter):  # the number slot starts empty
            cute.arch.barrier_arrive(
                barrier_id=BARRIER_TILE_EMPTY, number_of_threads=self.tile_handoff_threads
            )
        while tile < num_tiles:
            if const_expr(self.layout.ragged):
                # A varlen tile past the last batch has no rows: its O and LSE stores write nothing.
                info = self.ragged_tile_info(sched, tile, seqlen_k)
            else:
                m_block, head, batch, split = self.tile_coords(sched, tile)
                n_block_min, n_block_max, n_mask_min = self.n_block_range(
                    m_block, seqlen_q, seqlen_k, split, sched.num_splits
                )
                info = TileInfo(
                    m_block,
                    head,
                    batch,
                    seqlen_q,
                    seqlen_k,
                    n_block_max,
                    n_mask_min,
                    rows,
                    n_block_min,
                    split,
                )
            acc_O.fill(0.0)
            softmax.reset()
            # Grouped in the loop, not before it: the DSL carries acc_O through the loop (fill is
            # called on it), and the main loop takes the loop's acc_O, as the epilogue does.
            frags = WgFragments(
                wg, tSrQ, tSrK, tOrVt, tOrP, acc_O, s_shape, row_scale, thr_mma_qk, smem.sQ, smem.sK
            )
            if self.block_count(info) > 0:
                if self.has_no_rows(wg, info):
                    # All of this warpgroup's rows lie past the end of Q (the last m block of a
                    # seqlen that tile_m does not divide): it keeps the pipeline and the turns going
                    # but leaves the tensor cores and the MUFU to the warpgroups with rows.
                    kv, q_state = self.idle_mainloop(kv, q_state, wg, pipes, self.block_count(info))
                else:
                    kv, q_state = self.mainloop(kv, q_state, frags, mmas, pipes, softmax, info)
            lse = cute.make_rmem_tensor(softmax.num_rows, Float32)
            softmax.finalize(acc_O, lse)
            if const_expr(self.split):
                self.store_partials(acc_O, lse, stores.mO, stores.mLSE, mmas.pv, ctid, info)
                if const_expr(self.combine_in_kernel):
                    self.combine_last(acc_O, stores, final, smem.sO, mmas.pv, sched, ctid, info)
            else:
                self.epilogue(acc_O, lse, stores, smem.sO, mmas.pv, ctid, info)
            if const_expr(self.tile_counter):
                cute.arch.barrier(
                    barrier_id=BARRIER_TILE_FULL, number_of_threads=self.tile_handoff_threads
                )
                tile = sched.slot[0]
                if tile < num_tiles:
                    cute.arch.barrier_arrive(
                        barrier_id=BARRIER_TILE_EMPTY, number_of_threads=self.tile_handoff_threads
                    )
            else:
                tile = self.next_tile(tile, num_tiles)
        if const_expr(self.persistent):
            if self.is_o_storer(
                ctid
            ):  # the last O store must have read shared memory before the CTA exits
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def mainloop(
        self,
        kv: pipeline.PipelineState,
        q_state: pipeline.PipelineState,
        frags: WgFragments,
        mmas: TiledMmas,
        pipes: Pipelines,
        softmax: OnlineSoftmax,
        info: TileInfo,
    ):
        """All K/V blocks of one tile (n_block_max > 0), last block first. Returns the pipeline
        states for the next tile."""
        n_block_max, n_mask_min = info.n_block_max, info.n_mask_min
        pipes.q.consumer_wait(q_state)
        if const_expr(self.q_stages > 1):
            # This tile's Q buffer, for the S GEMMs and the recompute.
            sQ = frags.sQ
            tSrQ = frags.tSrQ[None, None, None, q_state.index]
            if const_expr(self.lazy_max):
                sQ = frags.sQ[None, None, q_state.index]
            frags = replace(frags, tSrQ=tSrQ, sQ=sQ)
        if const_expr(self.intra_wg_overlap):
            # First block: S GEMM, mask (seqlen and causal), softmax; its PV GEMM waits for the
            # next S GEMM to be issued.
            acc_S = cute.make_rmem_tensor(frags.s_shape, Float32)
            pipes.k.consumer_wait(kv)
            wgmma(
                mmas.qk,
                acc_S,
                frags.tSrQ,
                frags.tSrK[None, None, None, kv.index],
                accumulate=False,
                wait=0,
            )
            pipes.k.consumer_release(kv)
            self.mask_scores(acc_S, frags.thr_mma_qk, info, n_block_max - 1, self.causal)
            softmax.step(acc_S, True, frags.row_scale)
            convert_to_16bit(acc_as_operand_a(acc_S), frags.tOrP)
            n_masked = 0
            if const_expr(self.causal):
                first_masked = n_mask_min
                if const_expr(self.split):
                    first_masked = cutlass.max(n_mask_min, info.n_block_min)
                n_masked = cutlass.max(n_block_max - 1 - first_masked, 0)
            for i in cutlass.range(n_masked, unroll=1):
                kv = self.overlapped_step(
                    kv, n_block_max - 2 - i, True, frags, mmas, pipes, softmax, info
                )
            # The unmasked blocks: [n_block_min, n_unmasked_end), visited last first.
            n_unmasked_end = n_block_max - 1
            if const_expr(self.causal):
                n_unmasked_end = cutlass.min(n_block_max - 1, n_mask_min)
            n_unmasked = n_unmasked_end
            if const_expr(self.split):
                n_unmasked = cutlass.max(n_unmasked_end - info.n_block_min, 0)
            for i in cutlass.range(n_unmasked, unroll=1):
                kv = self.overlapped_step(
                    kv, n_unmasked_end - 1 - i, False, frags, mmas, pipes, softmax, info
                )
            # Every S GEMM of the tile is done: Q's buffer may take the next tile's Q (with two
            # buffers, the Q of the tile after next).
            self.release_q(pipes.q, q_state)
            # Last PV GEMM.
            pipes.v.consumer_wait(kv)
            wgmma(
                mmas.pv,
                frags.acc_O,
                frags.tOrP,
                frags.tOrVt[None, None, None, kv.index],
                accumulate=True,
                wait=0,
            )
            pipes.v.consumer_release(kv)
            kv.advance()
        else:
            self.turn_wait(frags.wg)
            n_masked = 1
            if const_expr(self.causal):
                first_masked = n_mask_min
                if const_expr(self.split):
                    first_masked = cutlass.max(n_mask_min, info.n_block_min)
                n_masked = cutlass.max(n_block_max - first_masked, 1)
            for i in cutlass.range(self.block_count(info), unroll=1):
                kv = self.serial_step(kv, i, n_masked, frags, mmas, pipes, softmax, info)
            self.turn_pass(frags.wg)
            self.release_q(pipes.q, q_state)
        q_state.advance()
        return kv, q_state

    def has_no_rows(self, wg: Int32, info: TileInfo):
        """Whether consumer warpgroup `wg` has no row of Q in this tile, checked only with three or
        four consumer warpgroups (tile_m 192 leaves one or two of them idle in the last m block of
        every power-of-two seqlen; tile_m 256 up to three below a multiple of 256). With two, whose
        tiles divide those seqlens, the branch buys nothing and moves the PV GEMM's wait in the
        SASS. Nor in persistent non-causal kernels: there the branch cost 2.5-3.7% at hdim 64,
        1k-16k tokens (H200), where causal ones gained 1-8%; without it their SASS is v6's.

        The tile's first row is marked warp-uniform before the compare. Without that, ptxas does not
        treat the branch as uniform, and a persistent CTA carries the pipeline states that leave it
        to its next tile: its main loop's stage and descriptor arithmetic then left the uniform
        datapath (41 R2UR). With the mark it keeps UIADD3.64 as in v6 (17 R2UR), yet persistent
        non-causal kernels still measured 2.5-3.7% slower with the branch (4-5% without the mark),
        for a reason not found; hence the gate above (docs/kernel-notes.md, v7)."""
        if const_expr(self.num_consumer_wg < 3 or (self.persistent and not self.causal)):
            return False
        first_row = cute.arch.make_warp_uniform(info.m_block * self.tile_m + wg * 64)
        return first_row >= info.rows

    @cute.jit
    def idle_mainloop(
        self,
        kv: pipeline.PipelineState,
        q_state: pipeline.PipelineState,
        wg: Int32,
        pipes: Pipelines,
        n_blocks: Int32,
    ):
        """The main loop of a warpgroup without rows in this tile: no GEMM and no softmax, only the
        pipeline's waits and releases (every consumer warp releases every stage, and waits for it
        first so as never to arrive a phase early) and the GEMM turns: the same stages, phases and
        turns as mainloop (with intra-warpgroup overlap, V's wait comes after the turn is passed).
        Its O stays zero; the epilogue writes neither its O rows (the TMA store clips them) nor its
        LSE.

        A release is one lane's arrive. In mainloop a wgmma (warpgroup-aligned) stands between
        each wait and its release, so every lane has seen the stage full before lane 0 frees it.
        Here a warp barrier does that: without it the compiler merged the releases around the V
        wait (lane 0: arrive K, wait V, arrive V; the other lanes: wait V), lane 0 could free V
        before the other lanes had seen it full, and once the stage was refilled those lanes waited
        on a phase of the same parity that never came (the hangs of docs/kernel-notes.md, v7)."""
        pipes.q.consumer_wait(q_state)
        if const_expr(self.intra_wg_overlap):
            self.idle_take(pipes.k, kv)
            for _ in cutlass.range(n_blocks - 1, unroll=1):
                kv_v = kv.clone()
                kv.advance()
                pipes.k.consumer_wait(kv)
                self.turn_wait(wg)
                self.turn_pass(wg)
                cute.arch.sync_warp()
                pipes.k.consumer_release(kv)
                self.idle_take(pipes.v, kv_v)
            self.release_q(pipes.q, q_state)
            self.idle_take(pipes.v, kv)
            kv.advance()
        else:
            self.turn_wait(wg)
            for _ in cutlass.range(n_blocks, unroll=1):
                pipes.k.consumer_wait(kv)
                self.turn_pass(wg)
                cute.arch.sync_warp()
                pipes.k.consumer_release(kv)
                pipes.v.consumer_wait(kv)
                self.turn_wait(wg)
                cute.arch.sync_warp()
                pipes.v.consumer_release(kv)
                kv.advance()
            self.turn_pass(wg)
            self.release_q(pipes.q, q_state)
        q_state.advance()
        return kv, q_state

    def idle_take(self, pipe, state):
        """Wait until the stage is full in every lane, then release it (one arrive per warp)."""
        pipe.consumer_wait(state)
        cute.arch.sync_warp()
        pipe.consumer_release(state)

    def release_q(self, pipe_q, q_state):
        # A single-tile CTA never reloads Q (and its O is staged in Q's buffer).
        if const_expr(self.persistent):
            pipe_q.consumer_release(q_state)

    @cute.jit
    def overlapped_step(
        self,
        kv: pipeline.PipelineState,
        n_block: Int32,
        masked: cutlass.Constexpr[bool],
        frags: WgFragments,
        mmas: TiledMmas,
        pipes: Pipelines,
        softmax: OnlineSoftmax,
        info: TileInfo,
    ):
        """S(n_block) = Q K^T issued before O += P V of the previous block; the softmax of S runs
        while that PV GEMM is in flight."""
        kv_v = kv.clone()
        kv.advance()
        acc_S = cute.make_rmem_tensor(frags.s_shape, Float32)
        pipes.k.consumer_wait(kv)
        self.turn_wait(frags.wg)
        wgmma(
            mmas.qk,
            acc_S,
            frags.tSrQ,
            frags.tSrK[None, None, None, kv.index],
            accumulate=False,
            wait=-1,
        )
        pipes.v.consumer_wait(kv_v)
        wgmma(
            mmas.pv,
            frags.acc_O,
            frags.tOrP,
            frags.tOrVt[None, None, None, kv_v.index],
            accumulate=True,
            wait=-1,
        )
        self.turn_pass(frags.wg)
        warpgroup.wait_group(1)
        if const_expr(not self.lazy_max):
            pipes.k.consumer_release(kv)
        if const_expr(masked):
            self.mask_scores(acc_S, frags.thr_mma_qk, info, n_block, True)
        if const_expr(self.lazy_max):
            self.lazy_step(acc_S, kv, n_block, masked, True, frags, softmax, info)
            pipes.k.consumer_release(kv)  # only now: the recompute reads K's stage
        else:
            softmax.step(acc_S, False, frags.row_scale)
        warpgroup.wait_group(0)
        pipes.v.consumer_release(kv_v)
        # P before the rescale: its conversions then sit among the exponentials, not behind the
        # rescale's branch.
        convert_to_16bit(acc_as_operand_a(acc_S), frags.tOrP)
        softmax.rescale(frags.acc_O, frags.row_scale)
        return kv

    @cute.jit
    def serial_step(
        self,
        kv: pipeline.PipelineState,
        i: Int32,
        n_masked: Int32,
        frags: WgFragments,
        mmas: TiledMmas,
        pipes: Pipelines,
        softmax: OnlineSoftmax,
        info: TileInfo,
    ):
        """Block i of the tile (K block n_block_max - 1 - i; the first n_masked are masked)
        without intra-warpgroup overlap: S GEMM, softmax, PV GEMM in sequence. The turn is passed
        after the S GEMM and taken back before the PV GEMM, so the other warpgroup's GEMMs run under
        this one's softmax."""
        n_block = info.n_block_max - 1 - i
        acc_S = cute.make_rmem_tensor(frags.s_shape, Float32)
        pipes.k.consumer_wait(kv)
        wgmma(
            mmas.qk,
            acc_S,
            frags.tSrQ,
            frags.tSrK[None, None, None, kv.index],
            accumulate=False,
            wait=-1,
        )
        self.turn_pass(frags.wg)
        warpgroup.wait_group(0)
        if const_expr(not self.lazy_max):
            pipes.k.consumer_release(kv)
        if i < n_masked:
            self.mask_scores(acc_S, frags.thr_mma_qk, info, n_block, self.causal)
        # P is converted in both branches, so that a block takes one run-time branch, not two, and
        # the conversion still comes before the rescale.
        if i == 0:
            softmax.step(acc_S, True, frags.row_scale)
            convert_to_16bit(acc_as_operand_a(acc_S), frags.tOrP)
        else:
            if const_expr(self.lazy_max):
                self.lazy_step(acc_S, kv, n_block, i < n_masked, self.causal, frags, softmax, info)
            else:
                softmax.step(acc_S, False, frags.row_scale)
            convert_to_16bit(acc_as_operand_a(acc_S), frags.tOrP)
            softmax.rescale(frags.acc_O, frags.row_scale)
        if const_expr(self.lazy_max):
            pipes.k.consumer_release(kv)  # only now: the recompute reads K's stage
        pipes.v.consumer_wait(kv)
        self.turn_wait(frags.wg)
        wgmma(
            mmas.pv,
            frags.acc_O,
            frags.tOrP,
            frags.tOrVt[None, None, None, kv.index],
            accumulate=True,
            wait=0,
        )
        pipes.v.consumer_release(kv)
        kv.advance()
        return kv

    @cute.jit
    def lazy_step(
        self,
        acc_S: cute.Tensor,
        kv: pipeline.PipelineState,
        n_block: Int32,
        masked,
        causal: cutlass.Constexpr[bool],
        frags: WgFragments,
        softmax: OnlineSoftmax,
        info: TileInfo,
    ):
        """The softmax of a block after the tile's first with `lazy_max`; where the rise is too
        large to rescale by, the scores again (masked as the caller masked them: `masked`, a flag or
        a run-time condition) and the exact step. The caller releases K's stage after this."""
        if softmax.step_lazy(acc_S, frags.row_scale):
            self.recompute_scores(acc_S, frags.sQ, frags.sK[None, None, kv.index], frags.thr_mma_qk)
            if masked:
                self.mask_scores(acc_S, frags.thr_mma_qk, info, n_block, causal)
            softmax.step(acc_S, False, frags.row_scale)

    @cute.jit
    def recompute_scores(self, acc_S, sQ_tile, sK_block, thr_mma_qk):
        """This thread's scores of the block again, from Q and K in shared memory on the FMA pipe:
        the lazy max's way back after a rise too large to rescale by (a score more than 125 above
        the running max in log2 units), when the exponentials have already overwritten the scores.
        Slow (head_dim FMAs per score, one column at a time), and taken only by a warp whose rows'
        scores rose that far. Its caller releases K's stage (one lane's arrive) only after the exact
        step that follows, whose row-max shuffles need every lane's recomputed scores: so every lane
        has read K here before the stage can be refilled."""
        scores = acc_rows_cols(acc_S)
        coords = acc_rows_cols(
            thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        )
        num_rows = cute.size(scores, mode=[0])
        num_cols = cute.size(scores, mode=[1])
        # One column at a time, head_dim steps each: few registers live beside the accumulators.
        for c in cutlass.range_constexpr(num_cols):
            dots = cute.make_rmem_tensor(num_rows, Float32)
            dots.fill(0.0)
            for k in cutlass.range(self.head_dim, unroll=1):
                key = sK_block[coords[0, c][1], k].to(Float32)
                for r in cutlass.range_constexpr(num_rows):
                    dots[r] = dots[r] + sQ_tile[coords[r, 0][0], k].to(Float32) * key
            for r in cutlass.range_constexpr(num_rows):
                scores[r, c] = dots[r]

    def is_o_storer(self, ctid):
        """Whether this consumer thread's warp issues O's TMA stores: the first consumer warp, or
        with `wg_epilogue` the first warp of each consumer warpgroup."""
        if const_expr(self.wg_epilogue):
            return ctid % 128 < 32
        return ctid < 32

    @cute.jit
    def store_partials(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mma_pv: cute.TiledMma,
        ctid: Int32,
        info: TileInfo,
    ):
        """Split-KV: this split's normalised O (fp32) and LSE straight from registers into the
        partials, rows inside Q only. A split without keys writes O 0 and LSE -inf, which the
        combine weighs by 0."""
        m_block, head, batch, split, rows = (
            info.m_block,
            info.head,
            info.batch,
            info.split,
            info.rows,
        )
        thr_mma = mma_pv.get_slice(ctid)
        mO_tile = mO[None, None, head, batch, split]
        lse_row0 = 0  # LSE row of the tile's row 0, beyond m_block * tile_m
        if const_expr(self.layout.varlen_q):
            # The partials of varlen Q are one batch of all rows; this batch's start at offset_q.
            mO_tile = mO[None, None, head, 0, split]
            start = (0, info.offset_q) if const_expr(self.pack_group > 1) else info.offset_q
            mO_tile = cute.domain_offset((start, 0), mO_tile)
            lse_row0 = self.pack_group * info.offset_q
        gO = cute.local_tile(mO_tile, (self.tile_m, self.head_dim_v), (m_block, 0))
        tOgO = acc_rows_cols(thr_mma.partition_C(gO))
        out = acc_rows_cols(acc_O)
        coords = acc_rows_cols(
            thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v)))
        )
        for r in cutlass.range_constexpr(cute.size(out, mode=[0])):
            row = m_block * self.tile_m + coords[r, 0][0]
            if row < rows:
                for c in cutlass.range_constexpr(cute.size(out, mode=[1])):
                    tOgO[r, c] = out[r, c]
                if coords[0, 0][1] == 0:
                    if const_expr(self.layout.varlen_q):
                        mLSE[lse_row0 + row, head, 0, split] = lse[r]
                    else:
                        mLSE[row, head, batch, split] = lse[r]

    @cute.jit
    def combine_last(
        self,
        acc_O: cute.Tensor,
        stores: OutputStores,
        final,
        sO: cute.Tensor,
        mma_pv: cute.TiledMma,
        sched: TileSchedule,
        ctid: Int32,
        info: TileInfo,
    ):
        """combine_in_kernel, after store_partials: count this split CTA in at its tile's counter;
        the tile's last CTA (the one whose add sees num_splits - 1) merges every split's partials
        into O and LSE, stores them through the unsplit kernel's epilogue, and puts the counter
        back to zero, so that the next launch (a CUDA graph's replay too) finds it there without a
        memset. `final`: O's and LSE's stores and the shared flag that says which CTA is last.

        Memory order, as the backward's deterministic semaphores take it: every consumer thread
        fences its partial stores (release at GPU scope) before the barrier, and one thread adds
        with acquire-release semantics; the last CTA's threads fence again (acquire) before they
        read the other splits' partials.

        The merge is the combine kernel's (combine.py) in meaning and in order, so that O and LSE
        are its own bit for bit: a row's max and sum of exp(LSE_s) are taken by one warp, lane l
        over splits l, l + 32, ... in order, then a butterfly over the lanes; O is summed over the
        splits in order from 0, acc + weight * O_s. Here a warp takes the 16 rows of its part of
        the MMA layout together (16 loads in flight, not one row's), and each thread sums O for the
        elements of its accumulator fragment, read where store_partials wrote them."""
        out_stores, last_slot = final
        mOpart, mLSEpart = stores.mO, stores.mLSE
        num_splits = sched.num_splits
        m_block, head, batch, rows = info.m_block, info.head, info.batch, info.rows
        cute.arch.fence_acq_rel_gpu()  # this thread's partials, before the count
        cute.arch.barrier(
            barrier_id=BARRIER_SPLIT_COUNT, number_of_threads=self.num_consumer_threads
        )
        if ctid == 0:
            counter = sched.counter
            num_m = (rows + self.tile_m - 1) // self.tile_m
            slot = (batch * cute.size(sched.mQ.shape[2]) + head) * num_m + m_block
            seen = cute.arch.atomic_add(
                counter.iterator + slot, Int32(1), sem="acq_rel", scope="gpu"
            )
            last = Int32(0)
            if seen == num_splits - 1:
                counter[slot] = Int32(0)  # every split has counted: this launch is done with it
                last = Int32(1)
            last_slot[0] = last
        cute.arch.barrier(
            barrier_id=BARRIER_SPLIT_COUNT, number_of_threads=self.num_consumer_threads
        )
        if last_slot[0] != 0:
            cute.arch.fence_acq_rel_gpu()  # the other splits' partials, after the count
            thr_mma = mma_pv.get_slice(ctid)
            coords = acc_rows_cols(
                thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v)))
            )
            num_rows = cute.size(coords, mode=[0])
            lane = cute.arch.lane_idx()
            row0 = m_block * self.tile_m
            # The warp's rows are WARP_ROWS consecutive ones from its lane 0's first.
            warp_row0 = cute.arch.make_warp_uniform(cute.arch.shuffle_sync(coords[0, 0][0], 0))
            row_max = cute.make_rmem_tensor(WARP_ROWS, Float32)
            row_max.fill(-Float32.inf)
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                for i in cutlass.range_constexpr(WARP_ROWS):
                    row = row0 + warp_row0 + i
                    if row < rows:
                        row_max[i] = cute.arch.fmax(row_max[i], mLSEpart[row, head, batch, s])
            shift = cute.make_rmem_tensor(WARP_ROWS, Float32)
            for i in cutlass.range_constexpr(WARP_ROWS):
                row_max[i] = warp_allreduce(row_max[i], cute.arch.fmax)
                # Every split empty: subtract 0 so that exp2 gives 0, not NaN.
                shift[i] = row_max[i] if row_max[i] != -Float32.inf else Float32(0.0)
            total = cute.make_rmem_tensor(WARP_ROWS, Float32)
            total.fill(0.0)
            for s in cutlass.range(lane, num_splits, 32, unroll=1):
                for i in cutlass.range_constexpr(WARP_ROWS):
                    row = row0 + warp_row0 + i
                    if row < rows:
                        total[i] = total[i] + cute.math.exp2(
                            (mLSEpart[row, head, batch, s] - shift[i]) * LOG2_E, fastmath=True
                        )
            # Each thread keeps the LSE of its fragment's rows.
            lse = cute.make_rmem_tensor(num_rows, Float32)
            lse.fill(-Float32.inf)
            for i in cutlass.range_constexpr(WARP_ROWS):
                row_total = warp_allreduce(total[i], lambda a, b: a + b)
                row_lse = -Float32.inf
                if row_max[i] != -Float32.inf:
                    row_lse = shift[i] + cute.math.log2(row_total, fastmath=True) * LN2
                for r in cutlass.range_constexpr(num_rows):
                    lse[r] = row_lse if coords[r, 0][0] == warp_row0 + i else lse[r]
            acc = cute.make_rmem_tensor_like(acc_O)
            acc.fill(0.0)
            out = acc_rows_cols(acc)
            # A row's splits in one loop, no branch inside: the loads of merge_unroll splits run
            # ahead of their FFMAs (sm90a SASS), not one L2 round trip per split and row. Each
            # value still sums the splits in order from 0.
            for r in cutlass.range_constexpr(num_rows):
                row = row0 + coords[r, 0][0]
                if row < rows:
                    for s in cutlass.range(num_splits, unroll=self.merge_unroll):
                        gO = cute.local_tile(
                            mOpart[None, None, head, batch, s],
                            (self.tile_m, self.head_dim_v),
                            (m_block, 0),
                        )
                        tOgO = acc_rows_cols(thr_mma.partition_C(gO))
                        lse_s = mLSEpart[row, head, batch, s]
                        weight = Float32(0.0)
                        if lse[r] != -Float32.inf:
                            weight = cute.math.exp2((lse_s - lse[r]) * LOG2_E, fastmath=True)
                        for c in cutlass.range_constexpr(cute.size(out, mode=[1])):
                            out[r, c] = out[r, c] + weight * tOgO[r, c]
            self.epilogue(acc, lse, out_stores, sO, mma_pv, ctid, info)

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        lse: cute.Tensor,
        stores: OutputStores,
        sO: cute.Tensor,
        mma_pv: cute.TiledMma,
        ctid: Int32,
        info: TileInfo,
    ):
        """Store the tile's O (through shared memory and a TMA store) and its LSE."""
        # Names of their own: the LSE store below writes through mLSE inside a run-time branch, and
        # the DSL carries a name written there through the branch (`stores`: the whole group).
        tma_o, mO, mLSE = stores.tma_o, stores.mO, stores.mLSE
        m_block, head, batch, seqlen_q = info.m_block, info.head, info.batch, info.rows
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        if const_expr(self.persistent):
            if self.is_o_storer(ctid):  # the previous tile's O store has read O's buffer
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # Single tile: every consumer has issued (and waited for) its last S GEMM, so Q's buffer is
        # free for O. Persistent: O's own buffer is free. With `wg_epilogue` a warpgroup waits only
        # for its own buffer: it does not wait for the others to finish their main loops, so it can
        # start the next tile while they still run their GEMMs (the ping-pong order carries on). Not
        # so in counter-scheduled (persistent causal) CTAs: the tile-number handoff after the
        # epilogue is a barrier of all consumers.
        wg = None
        sO_rows = sO
        if const_expr(self.wg_epilogue):
            wg = ctid // 128
            cute.arch.barrier(barrier_id=BARRIER_WG_O_FREE_FIRST + wg, number_of_threads=128)
            sO_rows = stages_as_rows(sO)
        else:
            cute.arch.barrier(
                barrier_id=BARRIER_EPILOGUE, number_of_threads=self.num_consumer_threads
            )
        store_atom = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype
        )
        thr_store = cute.make_tiled_copy_C(store_atom, mma_pv).get_slice(ctid)
        cute.copy(thr_store, thr_store.retile(rO), thr_store.partition_D(sO_rows))

        # LSE: the thread holding column 0 of a row writes it.
        thr_mma = mma_pv.get_slice(ctid)
        coords = acc_rows_cols(
            thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v)))
        )
        if coords[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.tile_m + coords[r, 0][0]
                if row < seqlen_q:
                    if const_expr(self.layout.varlen_q):
                        # (rows, head) of all batches; a row of packed GQA is group x query.
                        mLSE[self.pack_group * info.offset_q + row, head] = lse[r]
                    else:
                        mLSE[row, head, batch] = lse[r]

        # Make the stmatrix writes visible to the TMA engine; the first consumer warp (of each
        # warpgroup, with `wg_epilogue`) waits for all of them and stores the tile (its warpgroup's
        # rows), the others signal and are done.
        cute.arch.fence_view_async_shared()
        if const_expr(self.wg_epilogue):
            if not self.is_o_storer(ctid):
                cute.arch.barrier_arrive(
                    barrier_id=BARRIER_WG_O_WRITTEN_FIRST + wg, number_of_threads=128
                )
            else:
                cute.arch.barrier(barrier_id=BARRIER_WG_O_WRITTEN_FIRST + wg, number_of_threads=128)
                gO = cute.local_tile(
                    mO[None, None, head, batch],
                    (64, self.head_dim_v),
                    (m_block * self.num_consumer_wg + wg, 0),
                )
                tOsO, tOgO = cpasync.tma_partition(
                    tma_o,
                    0,
                    cute.make_layout(1),
                    cute.group_modes(sO, 0, 2),
                    cute.group_modes(gO, 0, 2),
                )
                cute.copy(tma_o, tOsO[None, wg], tOgO)
                cute.arch.cp_async_bulk_commit_group()
        elif ctid >= 32:
            cute.arch.barrier_arrive(
                barrier_id=BARRIER_O_WRITTEN, number_of_threads=self.num_consumer_threads
            )
        else:
            cute.arch.barrier(
                barrier_id=BARRIER_O_WRITTEN, number_of_threads=self.num_consumer_threads
            )
            mO_tile = mO[None, None, head, batch]
            if const_expr(self.layout.varlen_q):
                # The TMA store stops at the batch's last row (sm90/ragged.py).
                mO_tile = sequence_rows(
                    mO[None, None, head, None], info.offset_q, info.seqlen_q, self.pack_group > 1
                )
            gO = cute.local_tile(mO_tile, (self.tile_m, self.head_dim_v), (m_block, 0))
            tOsO, tOgO = cpasync.tma_partition(
                tma_o,
                0,
                cute.make_layout(1),
                cute.group_modes(sO, 0, 2),
                cute.group_modes(gO, 0, 2),
            )
            cute.copy(tma_o, tOsO, tOgO)
            cute.arch.cp_async_bulk_commit_group()
            if const_expr(not self.persistent):
                cute.arch.cp_async_bulk_wait_group(0, read=True)
