"""The compile-time knobs of the Hopper backward kernel: one schema, its legal values, the resource
model and the feasibility rules (shared with the search spaces and the kernel's constructor), and
the default config.

The kernel (kernel.py) gives each CTA `tile_n` rows of K and V of one K/V head; its consumer
warpgroups own 64 of those rows each, and walk the query heads of the K/V head's group and their Q
blocks of `tile_m` rows. Per Q block a warpgroup computes, for its K rows:

    S^T = K Q^T, dP^T = V dO^T            (wgmma, both operands in shared memory)
    P^T = exp2(S^T * scale_log2 - LSE2), dS^T = P^T * (dP^T * scale - D)   (registers)
    dV += P^T dO, dK += dS^T Q            (wgmma, P^T and dS^T from registers)

and writes dS^T to shared memory, from which the warpgroups together compute dQ = dS K for the Q
block (each warpgroup a slice of dQ's columns) and add it into an fp32 dQ accumulator in global
memory (with `dq_swap` as dQ^T = K^T dS^T, whose N is the Q rows: 80-row blocks): atomically, or
with `deterministic` in the order of the K blocks (a semaphore per Q block), so that the result is
bitwise repeatable. With `dq_tma` the warpgroups stage the block's dQ in
shared memory instead, and one thread adds it with TMA reductions (cp.reduce.async.bulk.tensor,
one per swizzle atom of columns) while the next block is computed."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

from ...problem import Problem
from ...target import Target
from ..family import Rule


class ConfigError(ValueError):
    """A config that names unknown knobs, holds illegal values, or cannot be built for a problem."""


THREADS_PER_WARPGROUP = 128
WGMMA_M = 64  # K rows per consumer warpgroup
ELEMENT_BYTES = 2
MBARRIER_BYTES = 8
SMEM_ALIGN = 1024
# (producer, consumer) registers after setmaxnreg, by consumer warpgroups: the consumers take what
# the producer warpgroup gives back (one warpgroup launches with 248, two with 168).
REGISTER_SPLIT = {1: (24, 240), 2: (24, 240)}
# A consumer thread's registers beyond its accumulators: addresses, loop state, the LSE and D of
# its columns, the mask's bound per column; more (EXTRA_STATE_REGS) with the deterministic turn's
# semaphore or one warpgroup carrying the CTA's loop alone. Calibrated on ptxas for sm_90a at the
# edge, head dim 64 with 128 Q rows (compile tests; docs/kernel-notes.md, session 37): two
# warpgroups, atomic: no spill at 1 or 2 stages, dq_tma or not, one or two dS^T buffers, causal
# or not, but for the one config of KNOWN_SPILLS; deterministic 4 bytes of spill stores, one
# warpgroup with dq_tma and one stage 4.
CONSUMER_OVERHEAD_REGS = 16
EXTRA_STATE_REGS = 16
# The overhead with dQ^T's GEMM (dq_swap), calibrated at its own edge, head dim 128 with 80 Q rows
# (the model's 128 + 80 + 20 + 16 = 244 there): ptxas builds every config of it the rules admit
# with this overhead without spills (a compile test builds them all).
SWAP_OVERHEAD_REGS = 12
# Configs the model admits that ptxas (nvidia-cutlass-dsl 4.8.1) spills anyway, as (head_dim,
# tile_m, tile_n, num_stages, dq_tma, ds_stages, causal, dq_warp, deterministic, q_halves): bytes
# of spill stores. A compile test builds every admitted config at the edge, so that this list
# cannot go stale unseen. The 80-row deterministic one: the producer warp's 24 registers, with the
# consumers walking the steps per query head (docs/kernel-notes.md, session 42); the
# deterministic mode takes the ladder's next config there (deterministic_config).
KNOWN_SPILLS = {
    (64, 128, 128, 2, True, 1, True, False, False, False): 12,
    (128, 80, 128, 2, True, 2, True, True, True, False): 8,
}

KNOBS: dict[str, tuple] = {
    "tile_m": (64, 80, 128),
    "tile_n": (64, 128),
    "num_stages": (1, 2),
    "deterministic": (False, True),
    "dq_tma": (False, True),
    "ds_stages": (1, 2),
    "dq_warp": (False, True),
    "dq_rows": (False, True),
    "dq_swap": (False, True),
    "q_halves": (False, True),
    "exp2_turns": (False, True),
    "dq_single": (False, True),
    "dq_flat": (False, True),
    "lse_early": (False, True),
    "split_loads": (False, True),
    "persistent": (False, True),
    "dv_early": (False, True),
}
# dq_single: the widest chunk of the head dim it builds without spills at
DQ_SINGLE_MAX_CHUNK = 96
# q_halves: the queries of a part of the Q block (wgmma N of S^T and dP^T)
HALF_ROWS = 64

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
# A CTA accumulates dK, dV and dQ for at most this many columns of the head dim: above it, the
# head dim is split into equal chunks, each its own CTA (S^T and dP^T, over the whole head dim,
# computed again for each chunk): head dims 192 and 256 are correct that way, not fast.
MAX_CHUNK = 128


def head_dim_chunk(head_dim: int) -> int:
    """Columns of dK, dV and dQ a CTA computes (head_dim itself up to MAX_CHUNK)."""
    return head_dim // -(-head_dim // MAX_CHUNK)


# dq_flat: the accumulator's order. Per (batch, query head), the rows (padded to the Q tile) in
# blocks, each block in slices of the head dim's columns, a block's slice (a slab) in the order a
# warpgroup's 64-row wgmma accumulator holds it (flat_dq_offset): without dq_swap FLAT_ROWS rows of
# dQ by flat_width columns, with dq_swap the Q block's rows by 64 columns (dQ^T's accumulator:
# its 64 rows are dQ's columns).
FLAT_ROWS = 64


def flat_width(config: BwdConfig, head_dim: int) -> int:
    """dq_flat: the columns of a warpgroup's slice of dQ: the CTA's chunk of the head dim with
    dq_rows or dq_single, else the chunk over the consumer warpgroups."""
    chunk = head_dim_chunk(head_dim)
    return chunk if config.dq_rows else chunk // config.dq_warpgroups


def flat_slab(config: BwdConfig, head_dim: int) -> tuple[int, int, bool]:
    """dq_flat: (dQ's rows, dQ's columns, transposed) of a slab of the accumulator, which one bulk
    reduction adds: FLAT_ROWS rows by flat_width columns in the order of dQ's accumulator, or with
    dq_swap the Q block's tile_m rows by 64 columns in the order of dQ^T's (64 x tile_m)."""
    if config.dq_swap:
        return config.tile_m, FLAT_ROWS, True
    return FLAT_ROWS, flat_width(config, head_dim), False


def flat_dq_offset(row: int, col: int, width: int) -> int:
    """dq_flat: where a 64 x width accumulator's value (row, col) lies in its slab (dQ's (row,
    col), or with dq_swap dQ's (col, row): flat_slab). A wgmma accumulator gives thread t = 32 w +
    4 r + c (warp w, quad r, place c) the rows 16 w + r and 16 w + r + 8 (h = 0, 1) of columns 8 j
    + 2 c and 8 j + 2 c + 1 (e = 0, 1) for each 8-column group j: its four values of group j lie
    side by side, (h, e) at 2 h + e, the warpgroup's 128 threads' fours in thread order, the
    groups one after the other."""
    w, h, r = row // 16, row % 16 // 8, row % 8
    j, c, e = col // 8, col % 8 // 2, col % 2
    assert 0 <= row < FLAT_ROWS and 0 <= col < width
    return j * 512 + (32 * w + 4 * r + c) * 4 + 2 * h + e


@dataclass(frozen=True)
class BwdConfig:
    """Compile-time knobs of the backward kernel.

    tile_m: Q rows per step of a CTA's walk.  tile_n: K/V rows per CTA, 64 per consumer warpgroup.
    num_stages: Q, dO, LSE and D buffers in flight (the producer loads the next block's while the
    consumers compute this one's).  deterministic: dQ's partial sums are added in the order of the
    K blocks (a semaphore per Q block), not as their CTAs finish, so that dQ is bitwise the same on
    every run.  dq_tma: each Q block's dQ goes through shared memory (fp32) and TMA reductions
    into the accumulator, instead of the consumer threads' red.global adds from registers.
    ds_stages: dS^T buffers in shared memory; with two, a Q block's dS^T goes into the other
    buffer from the last block's, so that no barrier waits for every warpgroup's dQ GEMM to have
    read it (the step's one barrier before the dQ GEMM orders both).  dq_warp (with dq_tma): each
    consumer warpgroup stages its slice of dQ's columns and hands it to a warp of the producer
    warpgroup, which issues that slice's TMA reduction; the warpgroup meets only that warp, not
    the other warpgroup (without it both meet twice a step around the one staging of the block's
    dQ, whose reduction the first consumer warp issues).  dq_rows (with dq_warp, tile_m 64 per
    consumer warpgroup): the warpgroups split dQ's GEMM by Q rows, each 64 rows and every column,
    not by columns, each all rows and d / warpgroups columns: wgmma N is the head dim, not half
    of it, each warpgroup reads half of dS instead of all of it, and its slice for the dQ warp is
    its rows.  dq_swap: the dQ GEMM computes dQ^T = K^T dS^T (M the head dim, 64 columns of dQ per
    consumer warpgroup; N the Q block's rows; K-dim tile_n), not dQ = dS K (M the Q rows, so tile_m
    a multiple of 64): what admits 80-row Q blocks (80 is a wgmma N, and 5 k-steps of the dK and dV
    GEMMs); each thread's dQ values reach sdQ or the accumulator transposed, one at a time.
    q_halves (tile_m 128): a warpgroup computes S^T, dP^T, P^T and dS^T of its keys in two parts
    of 64 queries each (m64 x n64 wgmmas), not at once (m64 x n128): a part's accumulators take
    half the registers, which leaves room for its queries' LSE2 and D, read before they are
    needed (config.stats_in_registers), and dV's and dK's GEMMs of the first part (K = its 64
    queries) run while the second part's exp2 does. S^T's and dP^T's GEMMs then read K and V
    from shared memory once per part.
    exp2_turns (two consumer warpgroups): the warpgroups take turns at the exp2 of S^T (each
    part's, q_halves), the second waiting for the first's, each waiting for the other's before
    its next, so that one warpgroup's exp2 runs on the MUFU while the other's GEMMs and dS^T run,
    instead of both warpgroups' exp2 at once with the tensor pipe idle (the forward's ping-pong,
    for the backward's exp2; two named barriers, no registers).
    dq_single (two consumer warpgroups, dq_warp, two dS^T buffers, dQ's GEMM not split by rows
    or swapped): the first warpgroup computes the Q block's whole dQ in one GEMM (wgmma N the
    chunk of the head dim, not half of it; twice the dQ registers) and hands it to the dQ warp as
    one slice; the second leaves its dS^T and goes on to its next step, so that the warpgroups
    no longer meet every step: the second runs up to a step ahead (bounded by the dS^T buffers),
    its exp2 beside the first's dQ GEMM (flash-attn-4's SM90 backward computes dQ in one
    warpgroup at head dim 96).
    dq_flat (dq_warp): a warpgroup stages its slice of dQ in the order its accumulator lies in
    registers (each thread's four values of an 8-column group side by side: 16-byte stores,
    consecutive threads at consecutive addresses, no bank conflict), not as a swizzled row-major
    tile (8-byte stores, two rows of a half-warp's on the same banks; with dq_swap 4-byte ones,
    dQ^T's pairs lying a row apart); the dQ warp adds each slab of the slice (flat_slab) with a
    bulk reduction of its bytes (no tensor map) into an accumulator laid out in the same order
    (flat_dq_offset), which the cast kernel (postprocess.py) reads back into dQ's rows and
    columns.
    lse_early (head dim 128, 80 rows, dq_swap, dq_flat, non-causal, no exp2_turns): LSE2 read
    into registers at the step's top, as the register model allows at 64 rows, where at 80 rows
    it finds no room and LSE2 is read at its use (whose loads stalled the exp2's FFMAs for 10% of
    the samples, session 53); ptxas builds it without spills in that one case.
    split_loads (head dims up to MAX_CHUNK): K and V, and each stage's Q (with its LSE2) and dO
    (with its D), on barriers of their own, loaded in the order K, Q, V, dO, so that a CTA's first
    S^T GEMM waits for K and Q alone, not for all four, and a step's S^T for its Q, not its dO
    (flash-attn-4's SM90 backward loads so).
    persistent (dq_warp; not deterministic, split_loads, lse_early, exp2_turns or a head dim in
    chunks): one CTA per SM, each walking the K blocks (x index, K/V head, batch, in the grid's
    launch order: kernel.cta_coords), not one CTA per K block: without the causal mask with a
    stride of the grid (the walks are of one length), with it the next from a counter (they are
    not); the producer loads the next walk's first Q and dO while the consumers finish this
    one's last steps and store its dK and dV, and its K and V once that store has read their
    buffers (it goes through them), so a CTA's start and the first loads' latency hide under its
    neighbour walk (the forward's `persistent`, for the backward's fixed cost a CTA:
    docs/kernel-notes.md, session 56).
    dv_early (dq_flat): P^T's dV GEMM is issued as soon as P^T is converted, before the wait for
    dP^T and the making of dS^T, not after dS^T is stored: the tensor pipe runs it while the
    warpgroup computes dS^T (P^T's bf16 registers live beside S^T and dP^T meanwhile: the
    register model counts them). With q_halves the last part's (the first part's dV and dK are
    queued behind the second part's S^T and dP^T already)."""

    tile_m: int = 64
    tile_n: int = 128
    num_stages: int = 2
    deterministic: bool = False
    dq_tma: bool = False
    ds_stages: int = 1
    dq_warp: bool = False
    dq_rows: bool = False
    dq_swap: bool = False
    q_halves: bool = False
    exp2_turns: bool = False
    dq_single: bool = False
    dq_flat: bool = False
    lse_early: bool = False
    split_loads: bool = False
    persistent: bool = False
    dv_early: bool = False

    def __post_init__(self) -> None:
        bad = []
        for f in fields(self):
            value, legal = getattr(self, f.name), KNOBS[f.name]
            same_kind = isinstance(value, bool) == isinstance(legal[0], bool)
            if not same_kind or value not in legal:
                bad.append(f"{f.name}={value!r} (legal: {', '.join(map(repr, legal))})")
        if bad:
            raise ConfigError("illegal knob value(s): " + "; ".join(bad))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, base: BwdConfig | None = None) -> BwdConfig:
        unknown = sorted(set(data) - set(KNOBS))
        if unknown:
            raise ConfigError(
                f"unknown knob(s) {', '.join(unknown)}; known knobs: {', '.join(KNOBS)}"
            )
        values = dict(data)
        for name in ("tile_m", "tile_n", "num_stages", "ds_stages"):
            if name in values and isinstance(values[name], float) and values[name].is_integer():
                values[name] = int(values[name])
        return replace(base, **values) if base is not None else cls(**values)

    def canonical(self) -> BwdConfig:
        return self

    def as_deterministic(self) -> BwdConfig:
        """The same tiles with dQ added in the order of the K blocks: by the dQ warp at the CTA's
        turn with dq_warp, else from registers (a reduction the first consumer warp issues as soon
        as the block is staged has no fixed order). From registers it may not fit where this
        config does (the turn takes registers): deterministic_config falls back. One CTA per
        walk (not persistent: a turn may wait for a walk queued behind it on the same CTA)."""
        if self.dq_warp:  # the dQ warp issues the reductions at the CTA's turn
            return replace(self, deterministic=True, persistent=False)
        return replace(self, deterministic=True, dq_tma=False, persistent=False)

    def short(self) -> str:
        return (
            f"{self.tile_m}x{self.tile_n}s{self.num_stages}{'-det' if self.deterministic else ''}"
            f"{'-tma' if self.dq_tma else ''}{'-w' if self.dq_warp else ''}"
            f"{'-r' if self.dq_rows else ''}{'-sw' if self.dq_swap else ''}"
            f"{'-ds2' if self.ds_stages == 2 else ''}{'-h2' if self.q_halves else ''}"
            f"{'-xt' if self.exp2_turns else ''}{'-q1' if self.dq_single else ''}"
            f"{'-fl' if self.dq_flat else ''}{'-le' if self.lse_early else ''}"
            f"{'-sl' if self.split_loads else ''}{'-ps' if self.persistent else ''}"
            f"{'-ve' if self.dv_early else ''}"
        )

    @property
    def consumer_warpgroups(self) -> int:
        return self.tile_n // WGMMA_M

    @property
    def dq_warpgroups(self) -> int:
        """The consumer warpgroups that compute dQ, a slice of its columns each (dq_single: the
        first alone, all of them)."""
        return 1 if self.dq_single else self.consumer_warpgroups

    @property
    def query_parts(self) -> int:
        """The parts of a Q block a warpgroup's S^T and dP^T are computed in (q_halves: two)."""
        return 2 if self.q_halves else 1


# ---- the resource model -------------------------------------------------------------------------
def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def stat_stage_rows(tile_m: int) -> int:
    """Values of a stage of the LSE2 or D buffer: tile_m, rounded up so that every stage starts
    128-byte aligned (a TMA copy's shared address): 96 for 80 rows."""
    return _round_up(tile_m, 32)


def smem_parts(config: BwdConfig, problem: Problem) -> dict[str, int]:
    """Bytes of shared memory by buffer: K and V of the CTA; per stage Q, dO, and the LSE and D of
    its rows; dS^T (tile_n x tile_m, ds_stages of them) for the dQ GEMM; with dq_tma the Q block's
    dQ (fp32); barriers and the semaphore slot."""
    d, dv, e = problem.head_dim, problem.head_dim_v, ELEMENT_BYTES
    stage = _round_up(config.tile_m * d * e, SMEM_ALIGN) + _round_up(
        config.tile_m * dv * e, SMEM_ALIGN
    )
    # The LSE2 and D buffers each start a 1024-byte block of their own (kernel.py's
    # SharedStorage), after the mbarriers': counted so, not packed (1 KB less than the kernel
    # takes, which mattered first at 80 rows: 227 KB, all of the H200's).
    stats = _round_up(config.num_stages * stat_stage_rows(config.tile_m) * 4, SMEM_ALIGN)
    return {
        "barriers": _round_up((2 + 2 * config.num_stages) * MBARRIER_BYTES, SMEM_ALIGN) + 2 * stats,
        "k": _round_up(config.tile_n * d * e, SMEM_ALIGN),
        "v": _round_up(config.tile_n * dv * e, SMEM_ALIGN),
        "q_do": config.num_stages * stage,
        "ds": config.ds_stages * _round_up(config.tile_n * config.tile_m * e, SMEM_ALIGN),
        "dq": _round_up(config.tile_m * head_dim_chunk(d) * 4, SMEM_ALIGN) if config.dq_tma else 0,
    }


def smem_reasons(config: BwdConfig, problem: Problem, target: Target) -> list[str]:
    parts = smem_parts(config, problem)
    used = sum(parts.values())
    if used > target.smem_per_block:
        detail = ", ".join(f"{k} {v // 1024} KB" for k, v in parts.items())
        return [
            f"shared memory {used / 1024:.0f} KB exceeds the {target.smem_per_block // 1024} KB "
            f"per block of {target.name} ({config.short()}, head dims {problem.head_dim}/"
            f"{problem.head_dim_v}: {detail})"
        ]
    return []


def consumer_registers_needed(config: BwdConfig, problem: Problem) -> int:
    """A consumer thread's registers at its peak (64 K rows, 128 threads per warpgroup): dK and
    dV of the CTA's chunk of the head dim (chunk/2 fp32 each) all along; then either S^T and dP^T
    of a Q block (tile_m/2 each, both live while dS^T is made) with P^T in bf16 (tile_m/4), or,
    while the dK and dV GEMMs still read P^T and dS^T in bf16 (tile_m/4 each), the warpgroup's
    slice of dQ (tile_m x chunk / 128 / the warpgroups that compute dQ: with dq_single the
    first warpgroup's whole dQ); and the overhead, more for the
    deterministic turn or a lone warpgroup. (ptxas serialized the wgmma at 240 registers with one
    warpgroup at head dim 128: its dQ slice is 64.) With q_halves: S^T and dP^T of one part
    (tile_m/4 each) while the dK and dV GEMMs of the part before still read its P^T and dS^T
    (tile_m/8 each). With dv_early a part's P^T in bf16 once more in that term (tile_m/4, with
    q_halves tile_m/8): ptxas spilled 29 bytes at 80 rows, head dim 128, where the term without
    it fits (session 65)."""
    chunk = head_dim_chunk(problem.head_dim)
    regs_dkv = chunk  # dK's and dV's chunk of columns, half a row each
    regs_sdp = config.tile_m + config.tile_m // 4
    if config.q_halves:
        regs_sdp = config.tile_m // 2 + config.tile_m // 4
    if config.dv_early:  # P^T in bf16 (dV's operand) beside S^T and dP^T while dS^T is made
        regs_sdp += config.tile_m // 4 // config.query_parts
    regs_dq = config.tile_m * chunk // 128 // config.dq_warpgroups
    regs_dq += config.tile_m // 2
    overhead = SWAP_OVERHEAD_REGS if config.dq_swap else CONSUMER_OVERHEAD_REGS
    if _extra_state(config):
        overhead += EXTRA_STATE_REGS
    return regs_dkv + max(regs_sdp, regs_dq) + overhead


def stats_in_registers(config: BwdConfig, problem: Problem) -> tuple[bool, bool]:
    """Whether a consumer thread reads the LSE2 and the D of its tile_m / 4 query columns (a
    part's, q_halves) into registers early: LSE2 before the step's (part's) S^T and dP^T GEMMs, D
    before the exp2 (each read from shared memory just before its use stalls the FFMAs and FADDs
    that take it). Each costs that many registers while S^T and dP^T are live: taken where the
    register model leaves that much room (head dim 128 with 64 rows: LSE2 alone; 128 rows at head
    dim 64: neither, ptxas spilled 20 bytes for LSE2 alone there, and 16 for D beside LSE2 at
    head dim 128 causal; both with q_halves)."""
    _, consumer = REGISTER_SPLIT[config.consumer_warpgroups]
    # dv_early's P^T in bf16 is made after the exp2, when LSE2 is read: not live beside it
    room = consumer - consumer_registers_needed(replace(config, dv_early=False), problem)
    stats = config.tile_m // 4 // config.query_parts
    return room >= stats or config.lse_early, room >= 2 * stats


def _extra_state(config: BwdConfig) -> list[str]:
    """What takes EXTRA_STATE_REGS beyond the overhead, by name (empty: nothing)."""
    return [
        what
        for what, applies in (
            ("the deterministic turn", config.deterministic and not config.dq_warp),
            ("one warpgroup's loop", config.consumer_warpgroups == 1),
        )
        if applies
    ]


def register_reasons(config: BwdConfig, problem: Problem, target: Target) -> list[str]:
    _, consumer = REGISTER_SPLIT[config.consumer_warpgroups]
    need = consumer_registers_needed(config, problem)
    if need > min(consumer, target.max_regs_per_thread):
        extra = _extra_state(config)
        return [
            f"consumer threads need about {need} registers (dK and dV {problem.head_dim}+"
            f"{problem.head_dim_v} columns, S and dP or dQ of {config.tile_m} Q rows"
            f"{''.join(', ' + e for e in extra)}) but get {consumer}: the kernel would spill or "
            "serialize its wgmma"
        ]
    if config.lse_early:
        if stats_in_registers(replace(config, lse_early=False), problem)[0]:
            return [
                f"lse_early where the register model keeps LSE2 in registers already "
                f"({config.short()}, head dim {problem.head_dim}): the same kernel"
            ]
        built = problem.head_dim == 128 and config.tile_m == 80 and config.dq_swap
        built = built and config.dq_flat and not problem.causal and not config.deterministic
        if not built or config.exp2_turns:
            return [
                "lse_early builds without spills only at head dim 128 with 80 rows, dq_swap and "
                "dq_flat, non-causal, neither deterministic nor exp2_turns "
                f"({config.short()}, head dim {problem.head_dim}"
                f"{' causal' if problem.causal else ''}: ptxas spilled 4-84 bytes elsewhere, "
                "session 54)"
            ]
    if config.persistent and (config.lse_early or config.exp2_turns):
        return [
            f"persistent with {'lse_early' if config.lse_early else 'exp2_turns'} "
            f"({config.short()}, head dim {problem.head_dim}): the walks' loop state beside "
            "registers already at the edge; ptxas spilled 24 bytes with lse_early (80 rows, head "
            "dim 128), 8 with the exp2 turns (head dim 64, 128 rows), session 56"
        ]
    if config.dv_early and not config.dq_flat:
        return [
            "dv_early without dq_flat: ptxas spilled 4-16 bytes in 24 of the 416 such configs "
            "the other rules admit at head dims 64, 96 and 128 (two stages of dS^T, dQ staged "
            "swizzled), none of the 208 with dq_flat (session 65)"
        ]
    wide = head_dim_chunk(problem.head_dim) > 96
    if config.dv_early and config.persistent and (wide or config.consumer_warpgroups == 1):
        return [
            f"dv_early with persistent at head dim {problem.head_dim} with "
            f"{config.consumer_warpgroups} consumer warpgroup(s) ({config.short()}): the walks' "
            "loop state beside P^T in bf16; ptxas spilled 12-24 bytes in every such config at "
            "head dim 128, 8-32 bytes with one warpgroup at 64 and 96 (non-causal), none with "
            "two at 64 or 96 (session 65)"
        ]
    key = (problem.head_dim, config.tile_m, config.tile_n, config.num_stages, config.dq_tma,
           config.ds_stages, problem.causal, config.dq_warp, config.deterministic,
           config.q_halves)  # fmt: skip
    if key in KNOWN_SPILLS:
        return [
            f"ptxas spills {KNOWN_SPILLS[key]} bytes for {config.short()} at head dim "
            f"{problem.head_dim}{' causal' if problem.causal else ''} (a compile test keeps "
            "config.KNOWN_SPILLS)"
        ]
    return []


def tile_reasons(config: BwdConfig, problem: Problem) -> list[str]:
    """The dQ GEMM splits the chunk of dQ's columns among the consumer warpgroups, in wgmma N
    steps of 8; its M (the Q rows) is a multiple of 64. Swapped (dq_swap), its M is dQ's columns,
    64 per warpgroup, and its N the Q rows (64 or 80): head dim 128 with two warpgroups. (Head dim
    64 with one, tile_n 64, compiles without spills too, but one warpgroup is the slow tile there
    and its 24 configs would overrun the train job's grid; 96 splits into 48-row Ms, no wgmma.)"""
    reasons = []
    wgs = config.consumer_warpgroups
    chunk = head_dim_chunk(problem.head_dim)
    if config.dq_swap:
        if problem.head_dim != 128 or wgs != 2:
            reasons.append(
                f"dq_swap at head_dim={problem.head_dim} with {wgs} consumer warpgroup(s): dQ^T's "
                "GEMM takes 64 of dQ's columns per warpgroup, head dim 128 with two (tile_n 128)"
            )
        if config.tile_m not in (64, 80):
            reasons.append(
                f"dq_swap with tile_m={config.tile_m}: its dQ^T accumulator of 64 x tile_m takes "
                "64 or 80 rows (the register model's S^T and dP^T of 128 rows do not fit beside it)"
            )
    elif config.tile_m % 64:
        reasons.append(
            f"tile_m={config.tile_m} without dq_swap: the dQ GEMM's M (the Q rows) is a multiple "
            "of 64"
        )
    if not config.dq_swap and chunk % (8 * config.dq_warpgroups):
        reasons.append(
            f"head_dim={problem.head_dim} (chunks of {chunk}) does not split into "
            f"{config.dq_warpgroups} column slices of a multiple of 8 (the dQ GEMM)"
        )
    if config.q_halves and problem.head_dim != 64:
        reasons.append(
            f"q_halves at head_dim={problem.head_dim}: built for head dim 64 (at 128 its 128-row "
            "Q blocks do not fit the registers; at 96 ptxas spilled 76 bytes)"
        )
    if config.q_halves and wgs != 2:
        reasons.append(
            f"q_halves with {wgs} consumer warpgroup(s): built for two (tile_n 128; with one, "
            "ptxas spilled 8-12 bytes beside the register adds of dQ)"
        )
    if config.dq_single and wgs != 2:
        reasons.append(
            f"dq_single with {wgs} consumer warpgroup(s): the first of two computes dQ (tile_n 128)"
        )
    if config.dq_single and chunk > DQ_SINGLE_MAX_CHUNK:
        reasons.append(
            f"dq_single at head_dim={problem.head_dim} (chunks of {chunk}): the first "
            f"warpgroup's dQ of {chunk} columns beside its dK and dV spills (chunks of at most "
            f"{DQ_SINGLE_MAX_CHUNK} build clean; at 128, 8-24 bytes and serialized wgmma)"
        )
    if config.exp2_turns and wgs != 2:
        reasons.append(
            f"exp2_turns with {wgs} consumer warpgroup(s): the turns are between two (tile_n 128)"
        )
    if config.q_halves and config.tile_m != 2 * HALF_ROWS:
        reasons.append(
            f"q_halves with tile_m={config.tile_m}: the parts are {HALF_ROWS} queries each (wgmma "
            f"N of S^T and dP^T), tile_m {2 * HALF_ROWS}"
        )
    if config.split_loads and chunk != problem.head_dim:
        reasons.append(
            f"split_loads at head_dim={problem.head_dim} (chunks of {chunk}): built for the "
            f"head dims a CTA takes whole (up to {MAX_CHUNK}; the chunked producer loads as before)"
        )
    if config.persistent and chunk != problem.head_dim:
        reasons.append(
            f"persistent at head_dim={problem.head_dim} (chunks of {chunk}): built for the head "
            f"dims a CTA takes whole (up to {MAX_CHUNK})"
        )
    if problem.head_dim != problem.head_dim_v:
        reasons.append(
            f"head_dim_v={problem.head_dim_v} differs from head_dim={problem.head_dim}: the "
            "backward kernel takes equal head dims"
        )
    return reasons


def dq_reasons(config: BwdConfig) -> list[str]:
    reasons = []
    if config.dq_tma and config.deterministic and not config.dq_warp:
        reasons.append(
            "dq_tma with deterministic but without dq_warp: the first consumer warp issues a "
            "block's reductions as soon as it is staged, not at the CTA's turn (the dQ warp "
            "waits for it)"
        )
    if config.dq_warp and not config.dq_tma:
        reasons.append("dq_warp without dq_tma: the dQ warp issues TMA reductions")
    if config.dq_rows and not config.dq_warp:
        reasons.append("dq_rows without dq_warp: the dQ warp reduces each warpgroup's rows")
    if config.dq_rows and config.dq_swap:
        reasons.append("dq_rows with dq_swap: dQ^T's GEMM splits the columns, not the rows")
    if config.dq_single and not config.dq_warp:
        reasons.append(
            "dq_single without dq_warp: the first warpgroup hands its dQ to the dQ "
            "warp (the other dQ paths have both warpgroups meet around dQ)"
        )
    if config.dq_single and config.ds_stages != 2:
        reasons.append(
            f"dq_single with ds_stages={config.ds_stages}: the second warpgroup writes the next "
            "step's dS^T while the first's dQ GEMMs read this one (two buffers)"
        )
    if config.dq_single and (config.dq_rows or config.dq_swap):
        reasons.append(
            "dq_single with dq_rows or dq_swap: those split dQ's GEMM between the warpgroups"
        )
    if config.dq_single and config.exp2_turns:
        reasons.append("dq_single with exp2_turns: both pace the warpgroups (built apart)")
    if config.dq_flat and not config.dq_warp:
        reasons.append("dq_flat without dq_warp: the dQ warp issues the bulk reductions")
    if config.persistent and not config.dq_warp:
        reasons.append(
            "persistent without dq_warp: a walk's last dQ reductions run on under the next walk "
            "through the dQ warp's handshake (the consumers' own dQ paths are not built for it)"
        )
    if config.persistent and config.deterministic:
        reasons.append(
            "persistent with deterministic: a CTA's walk would wait for a dQ turn that only a "
            "walk queued behind it on the same CTA can pass"
        )
    if config.persistent and config.split_loads:
        reasons.append(
            "persistent with split_loads: the next walk's loads are ordered Q, dO, then K and V "
            "(after this walk's dK and dV have left their buffers), on two barriers"
        )
    if config.dq_rows and config.tile_m != 64 * config.consumer_warpgroups:
        reasons.append(
            f"dq_rows with tile_m={config.tile_m}: each of the {config.consumer_warpgroups} "
            "consumer warpgroups takes 64 Q rows of the dQ GEMM (tile_m "
            f"{64 * config.consumer_warpgroups})"
        )
    return reasons


MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z extents


def grid_reasons(problem: Problem) -> list[str]:
    """Why the launch grid cannot hold the problem: its y extent is the K/V heads (or fewer, by
    sections: kernel.cta_coords) and its z extent the batch, both capped by CUDA."""
    return [
        f"{name} {value} > {MAX_GRID_YZ} (the backward grid's {axis} extent); split the {name}"
        for name, value, axis in (
            ("K/V heads", problem.nheads_kv, "y"),
            ("batch", problem.batch, "z"),
        )
        if value > MAX_GRID_YZ
    ]


def unsupported_reasons(problem: Problem, target: Target) -> list[str]:
    reasons = []
    if target.arch != "sm_90a":
        reasons.append(
            f"the fa4 backward kernel is built for sm_90a; {target.name} is {target.arch}"
        )
    for name in ("head_dim", "head_dim_v"):
        value = getattr(problem, name)
        if value not in SUPPORTED_HEAD_DIMS:
            reasons.append(
                f"{name}={value} not supported by the backward kernel (supported: "
                f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
            )
    if problem.layout.ragged:
        reasons.append("the backward kernel takes batch-shaped inputs only (no varlen or paged)")
    return reasons + grid_reasons(problem)


RULES = (
    Rule("wgmma shapes", lambda problem, config, target: tile_reasons(config, problem)),
    Rule("shared memory", lambda problem, config, target: smem_reasons(config, problem, target)),
    Rule("registers", lambda problem, config, target: register_reasons(config, problem, target)),
    Rule("dQ adds", lambda problem, config, target: dq_reasons(config)),
)


# The default's candidates, first that fits: 128 Q rows a step with dQ's TMA reductions issued by
# the dQ warp, two dS^T buffers, dQ's GEMM split by rows and S^T and dP^T in halves of the Q block,
# dQ staged flat (fits at head dim 64 only; there the halves 1.027-1.058x the whole block on the six
# grid shapes, H100 SXM, session 48; the rows split 1.02-1.04x the column split, and 128 rows
# 1.17-1.22x the 64-row default, on the H200; dq_flat 1.026-1.098x, session 52), then the same
# without the halves or dq_flat, then with dQ's GEMM split by columns, then 80 rows with dQ's GEMM
# swapped, staged flat, LSE2 in registers (lse_early: fits at head dim 128 non-causal only;
# 1.021-1.039x the 64-row swapped rung on the four head-dim-128 non-causal shapes of the train job,
# two runs, H100 SXM, session 54; without lse_early 0.999-1.022x), then 64 rows with dQ's GEMM
# swapped (dQ^T; fits at head dim 128 only, 1.02-1.08x the unswapped 64 rows on all eight
# head-dim-128 shapes of the train job, H100 SXM, session 44; unswapped with dq_flat ties it,
# swapped with dq_flat 0.995x, session 53), then 64 rows with dQ's whole GEMM in the first
# warpgroup, staged flat (fits at head dim 96 only; 1.023-1.076x the two warpgroups' column split on
# the six head-dim-96 grid shapes, H100 SXM, session 51; dq_flat 1.031-1.079x on the same, session
# 52), then 64 rows unswapped (the dQ warp 1.06-1.14x the consumer-issued reductions at head dim
# 128, 1.08-1.11x at 64; two dS^T buffers +0.5-1.8% at 128), then the consumer warp issuing the
# reductions, dQ by TMA alone (the TMA reductions 1.08-1.25x the register adds at head dims 64 and
# 128), the register adds, and one stage (docs/kernel-notes.md, sessions 37 to 40).
DEFAULT_LADDER = (
    BwdConfig(
        tile_m=128,
        dq_tma=True,
        ds_stages=2,
        dq_warp=True,
        dq_rows=True,
        q_halves=True,
        dq_flat=True,
    ),
    BwdConfig(tile_m=128, dq_tma=True, ds_stages=2, dq_warp=True, dq_rows=True),
    BwdConfig(tile_m=128, dq_tma=True, ds_stages=2, dq_warp=True),
    BwdConfig(
        tile_m=80,
        dq_tma=True,
        ds_stages=2,
        dq_warp=True,
        dq_swap=True,
        dq_flat=True,
        lse_early=True,
    ),
    BwdConfig(dq_tma=True, ds_stages=2, dq_warp=True, dq_swap=True),
    BwdConfig(dq_tma=True, ds_stages=2, dq_warp=True, dq_single=True, dq_flat=True),
    BwdConfig(dq_tma=True, ds_stages=2, dq_warp=True),
    BwdConfig(tile_m=128, dq_tma=True, ds_stages=2),
    BwdConfig(dq_tma=True, ds_stages=2),
    BwdConfig(dq_tma=True),
    BwdConfig(),
    BwdConfig(num_stages=1),
)


def _fits(config: BwdConfig, problem: Problem, target: Target) -> bool:
    return not any(rule(problem, config, target) for rule in RULES)


def default_config(problem: Problem, target: Target) -> BwdConfig:
    """The first of DEFAULT_LADDER that fits the problem (the last one if none does: the caller
    reports its reasons)."""
    for config in DEFAULT_LADDER:
        if _fits(config, problem, target):
            return config
    return config


def deterministic_config(config: BwdConfig, problem: Problem, target: Target) -> BwdConfig:
    """What runs `config`'s problem with dQ's sums in a fixed order: its own tiles where the
    deterministic turn fits beside them, else the first of the default's ladder that fits so."""
    if config.deterministic:
        return config
    for candidate in (config, *DEFAULT_LADDER):
        candidate = candidate.as_deterministic()
        if _fits(candidate, problem, target):
            return candidate
    return candidate
