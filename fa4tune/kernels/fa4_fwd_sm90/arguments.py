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
class TileSchedule:
    """How a CTA finds its tiles: the tile grid, the causal order and the tile counter."""

    mQ: cute.Tensor  # its shape gives the tiles: m blocks x heads x batches
    heads_per_l2_group: Int32  # causal tiles are ordered by groups of this many heads
    # A counter-scheduled CTA's producer takes tile numbers from the global counter and hands them
    # to the consumers through the shared slot; both are None in other kernels.
    counter: cute.Tensor | None
    slot: cute.Tensor | None
    num_splits: Int32 | None = None  # split-KV: CTAs per tile (None without)


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
