"""The argument groups that FlashForwardSm90's device methods pass each other.

Each group holds values that travel together and stay the same across the dynamic loops that use
them; the pipeline states, which those loops advance and return, are passed on their own. Grouping
leaves the compiled code as it was, given how the DSL's AST preprocessing treats a dynamic region
(scf.for, scf.while, scf.if): of the names bound before the region, it carries through it, as
region values, every name written there (`x = ...`, `x[i] = ...`) and every name whose method is
called there (`x.fill(0.0)`, `x.y.wait()`), except frozen dataclasses that are only called (such as
the pipelines themselves); names that are only read are not carried. Hence:

- the groups are frozen dataclasses, so that calling a group member's method in a loop
  (`pipes.k.consumer_wait(kv)`) carries nothing, as `pipe_k.consumer_wait(kv)` carried nothing;
- nothing is written through a group inside a dynamic region (that would carry the whole group):
  the kernel binds such a tensor to a name of its own first, as the tile slot and LSE are;
- a value that the DSL does carry through a loop (acc_O, which the consumers' tile loop fills) is
  grouped inside that loop, so that the methods it is passed to see the loop's value, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32


@dataclass(frozen=True)
class TmaLoads:
    """The producer's TMA atoms for Q, K and V and their global tensors (seqlen, d, head, batch)."""

    tma_q: cute.CopyAtom
    tma_k: cute.CopyAtom
    tma_v: cute.CopyAtom
    mQ: cute.Tensor
    mK: cute.Tensor
    mV: cute.Tensor
    page_table: cute.Tensor | None = None  # a paged cache's (batch, max_pages) page ids


@dataclass(frozen=True)
class KvSource:
    """Where the producer loads K or V blocks from, for one tile: its TMA atom and pipeline, the
    TMA's share of each stage (`smem`), and the block's coordinates (`gmem`): batch-shaped or
    packed rows, the tile's blocks (a block mode last); paged, the rows view of the tile's K/V head
    (rows, d, ends), which each block's page boxes index through the page table."""

    tma: cute.CopyAtom
    pipe: pipeline.PipelineTmaAsync
    smem: cute.Tensor  # (TMA, stages), or paged (TMA, boxes, 1, stages)
    gmem: cute.Tensor
    # Paged only: one box of a stage (what a box's coordinates are partitioned against), the page
    # table and the head dim of the rows.
    box: cute.Tensor | None = None
    page_table: cute.Tensor | None = None
    dim: int = 0


@dataclass(frozen=True)
class OutputStores:
    """Where the consumers write a tile: O's TMA store atom and O, and LSE (seqlen, head, batch)."""

    tma_o: cute.CopyAtom
    mO: cute.Tensor
    mLSE: cute.Tensor


@dataclass(frozen=True)
class SharedTensors:
    """The CTA's shared-memory tiles: Q, K and V as the TMA loads them, and O's staging buffer."""

    sQ: cute.Tensor  # (tile_m, d), with a stage mode when q_stages is 2
    sK: cute.Tensor  # (tile_n, d, num_stages)
    sV: cute.Tensor  # (tile_n, dv, num_stages)
    # (tile_m, dv), or (64, dv, consumer warpgroups) with wg_epilogue; in Q's memory in a
    # single-tile CTA (not persistent), where Q is dead by the epilogue.
    sO: cute.Tensor


@dataclass(frozen=True)
class Pipelines:
    """The TMA + mbarrier pipelines from the producer warp to the consumers: Q, K and V."""

    q: pipeline.PipelineTmaAsync  # q_stages
    k: pipeline.PipelineTmaAsync  # num_stages
    v: pipeline.PipelineTmaAsync  # num_stages


@dataclass(frozen=True)
class TiledMmas:
    """The two GEMMs: S = Q K^T (both operands in shared memory), O += P V (P in registers)."""

    qk: cute.TiledMma
    pv: cute.TiledMma


@dataclass(frozen=True)
class Sequences:
    """Where each batch's queries and keys lie in ragged inputs: each tensor None where that input
    is batch-shaped (flash-attn-4's arguments, int32 on the device)."""

    cu_seqlens_q: cute.Tensor | None  # (batch + 1,): batch b's queries are rows [cu[b], cu[b+1])
    cu_seqlens_k: cute.Tensor | None  # (batch + 1,): the same for keys and values
    seqused_k: cute.Tensor | None  # (batch,): batch b uses only its first seqused_k[b] keys
    page_table: cute.Tensor | None  # (batch, max_pages): the pages of batch b's keys, in order
    # Batch-shaped K and V seen as packed rows (with seqused_k): batch b's keys start at row
    # b * kv_batch_rows.
    kv_batch_rows: Int32 | None = None


@dataclass(frozen=True)
class TileSchedule:
    """How a CTA finds its tiles: the tile grid, the causal order and the tile counter."""

    mQ: cute.Tensor  # its shape gives the tiles: m blocks x heads x batches
    heads_per_l2_group: Int32  # causal tiles are ordered by groups of this many heads
    # A counter-scheduled CTA's producer takes tile numbers from the global counter and hands them
    # to the consumers through the shared slot; both are None in other kernels.
    counter: cute.Tensor | None
    slot: cute.Tensor | None
    num_splits: Int32 | None = None  # split-KV: CTAs per tile (None without)
    # Ragged inputs (None: every input batch-shaped). With varlen Q the tiles are numbered over
    # the sequences' m blocks (FlashForwardSm90.varlen_tile).
    seqs: Sequences | None = None


@dataclass(frozen=True)
class TileInfo:
    """One tile of O: where it lies, the sequence lengths, and the range of its K blocks (with
    split-KV, this CTA's share of them)."""

    m_block: Int32
    head: Int32
    batch: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    n_block_max: Int32  # K blocks [0, n_block_max) are visible to the tile (to this split)
    n_mask_min: Int32  # [n_mask_min, n_block_max) cross the diagonal (causal)
    rows: Int32  # rows of Q: seqlen_q, or group x seqlen_q with packed GQA
    # Split-KV (None without): this CTA's first K block, and which split it is.
    n_block_min: Int32 | None = None
    split: Int32 | None = None
    # Ragged inputs (None when batch-shaped): the first row of the batch's queries in packed Q, and
    # of its keys in packed K and V (varlen K, or batch-shaped K seen as rows).
    offset_q: Int32 | None = None
    offset_k: Int32 | None = None


@dataclass(frozen=True)
class WgFragments:
    """A consumer thread's views of its warpgroup's GEMMs and softmax in the main loop."""

    wg: Int32  # the consumer warpgroup, 0-based (warp-uniform)
    tSrQ: cute.Tensor  # Q as the S GEMM's A operand (with a stage mode when q_stages is 2)
    tSrK: cute.Tensor  # K as its B operand, per stage
    tOrVt: cute.Tensor  # V^T as the PV GEMM's B operand, per stage
    tOrP: cute.Tensor  # P in registers (16-bit), the PV GEMM's A operand
    acc_O: cute.Tensor  # the O accumulator (fp32)
    s_shape: cute.Shape  # the shape of one block's S accumulator (a fresh one per block)
    row_scale: cute.Tensor  # per row of this thread: the factor O is rescaled by after a step
    thr_mma_qk: cute.ThrMma  # this thread's slice of the S GEMM: where its scores lie in the tile
    # Q and K in shared memory, for the lazy max's recompute: sQ with a stage mode (q_stages 2)
    # until mainloop picks the tile's stage, sK per stage.
    sQ: cute.Tensor
    sK: cute.Tensor
