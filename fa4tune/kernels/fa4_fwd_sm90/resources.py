"""Shared-memory, register and tiling estimates of the Hopper forward kernel.

The one place where the kernel's resource use is modelled: the search-space plugins reject configs
with these functions before anything compiles, and the kernel's constructor refuses the same configs
with the same reasons. Limits come from the Target, never from literals here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...target import Target

if TYPE_CHECKING:  # imported for type names only; config imports this module
    from ...problem import InputLayout, Problem
    from .config import FwdConfig

THREADS_PER_WARPGROUP = 128
WGMMA_M = 64  # rows of Q per consumer warpgroup (one wgmma atom)
ELEMENT_BYTES = 2  # bf16 / fp16
MBARRIER_BYTES = 8
SMEM_ALIGN = 1024  # each swizzled buffer is 1024-byte aligned (128B swizzle atom)

# setmaxnreg budgets (producer, consumer) per number of consumer warpgroups. Both are multiples of 8
# as setmaxnreg requires. The block launches with the registers per thread that one block per SM
# allows (launch_registers); setmaxnreg.inc then takes registers only from what the block's own
# setmaxnreg.dec gave back, and waits for ever if that is too little: the consumers may gain no more
# than the producer warpgroup released (four consumer warpgroups launch with 96, so 120 hung).
REGISTER_SPLIT = {1: (24, 240), 2: (24, 240), 3: (32, 160), 4: (24, 112)}
# Registers a consumer thread needs beyond the accumulators: addresses, loop state, softmax
# statistics, masks; measured against ptxas on this kernel (see docs/kernel-notes.md). At the edge
# the estimate is loose: three warpgroups without intra-warpgroup overlap at exactly 160 spill
# (hdim 64 192x192: 80 bytes, hdim 96 192x160: 24, hdim 128 192x128: 4), with overlap they do not
# (hdim 64 192x128). They stay admitted: the first measured fastest at hdim 64 4k causal in two
# searches (runs 6 and 8; run 9 took 256x96 there), so a spill is for the search to judge
# (tests/test_kernel_compile.py lists the spills the shipped table may keep). Session 25 compiled
# 118 configs of the kernel with the lazy max (bf16, non-causal, persistent where it fits, every
# tile_m, tile_n and overlap the rules admit at head dims 64, 96, 128, 192, 256): none of those
# three spills there; the one config that did is two warpgroups with overlap at exactly 240 (hdim
# 192, 128x160, one stage): 48 bytes, and ptxas serialized its wgmma (C7512). Admitted like the
# others: one trial.
CONSUMER_OVERHEAD_REGS = {1: 24, 2: 24, 3: 32, 4: 32}
# Four warpgroups without intra-warpgroup overlap, half or more of the exponentials emulated: the
# polynomial's temporaries need more (ptxas, hdim 64: 256x96 spilled 24 bytes at 112, 256x80 did
# not).
EMULATION_REGS_SERIAL = {4: 8}


def num_consumer_warpgroups(config: FwdConfig) -> int:
    return config.tile_m // WGMMA_M


def num_threads(config: FwdConfig) -> int:
    return THREADS_PER_WARPGROUP * (num_consumer_warpgroups(config) + 1)


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def smem_layout_bytes(config: FwdConfig, problem: Problem) -> dict[str, int]:
    """Bytes of each shared-memory buffer. A single-tile CTA stages O through Q's buffer (Q is dead
    once the last S GEMM has read it), so that region is sized for the larger of the two; a
    persistent CTA loads the next Q while O is stored, so O has a buffer of its own (and Q q_stages
    of them)."""
    d, dv = problem.head_dim, problem.head_dim_v
    q = config.tile_m * d * ELEMENT_BYTES
    o = config.tile_m * dv * ELEMENT_BYTES
    k = config.num_stages * config.tile_n * d * ELEMENT_BYTES
    v = config.num_stages * config.tile_n * dv * ELEMENT_BYTES
    # full + empty barrier per stage for K and for V, plus a pair per Q buffer.
    barriers = (2 * config.q_stages + 4 * config.num_stages) * MBARRIER_BYTES
    if config.uses_tile_counter(problem.causal):
        barriers += (
            8  # the next tile's number (padded to 8), handed from the producer to the consumers
        )
    if config.combine_in_kernel:
        barriers += 8  # whether this CTA is its tile's last split (padded to 8), for the consumers
    if config.persistent:
        q_o = {"q": _round_up(config.q_stages * q, SMEM_ALIGN), "o": _round_up(o, SMEM_ALIGN)}
    else:
        q_o = {"q_o": _round_up(max(q, o), SMEM_ALIGN)}
    return {
        "barriers": _round_up(barriers, SMEM_ALIGN),
        **q_o,
        "k": _round_up(k, SMEM_ALIGN),
        "v": _round_up(v, SMEM_ALIGN),
    }


def smem_bytes(config: FwdConfig, problem: Problem) -> int:
    return sum(smem_layout_bytes(config, problem).values())


def smem_reasons(config: FwdConfig, problem: Problem, target: Target) -> list[str]:
    used = smem_bytes(config, problem)
    if used > target.smem_per_block:
        parts = ", ".join(
            f"{k} {v // 1024} KB" for k, v in smem_layout_bytes(config, problem).items()
        )
        return [
            f"shared memory {used / 1024:.0f} KB exceeds the {target.smem_per_block // 1024} KB "
            f"per block of {target.name} (tile_m={config.tile_m}, tile_n={config.tile_n}, "
            f"num_stages={config.num_stages}{', persistent' if config.persistent else ''}"
            f"{f', q_stages={config.q_stages}' if config.q_stages > 1 else ''}, head dims "
            f"{problem.head_dim}/{problem.head_dim_v}: {parts})"
        ]
    return []


def consumer_registers_needed(config: FwdConfig, problem: Problem) -> int:
    """fp32 accumulator registers one consumer thread holds at its peak, plus the fixed overhead.

    Per warpgroup (64 rows, 128 threads): O is 64·dv fp32 (dv/2 per thread), S is 64·tile_n fp32
    (tile_n/2). With intra-warpgroup overlap the next S is live while the current P (bf16, tile_n/4)
    waits for its PV GEMM."""
    wgs = num_consumer_warpgroups(config)
    regs_o = WGMMA_M * problem.head_dim_v // THREADS_PER_WARPGROUP
    regs_s = WGMMA_M * config.tile_n // THREADS_PER_WARPGROUP
    regs_p = regs_s // 2 if config.intra_wg_overlap else 0
    regs_emu = 0
    if not config.intra_wg_overlap and config.emu_share >= 0.5:
        regs_emu = EMULATION_REGS_SERIAL.get(wgs, 0)
    return regs_o + regs_s + regs_p + regs_emu + CONSUMER_OVERHEAD_REGS.get(wgs, 32)


# With ragged inputs the producer warp also finds its tile's batch (a warp-wide scan of
# cu_seqlens_q) and, paged, a page id and a box's coordinates per page. One consumer warpgroup
# launches with 248 registers and keeps 240: there 24 spilled (16-row pages, 64 bytes) and 56
# leaves the register file half used. Two launch with 168, which 24/240 uses up: with pages the
# consumers give 8 of theirs for 16 more each in the producer (8-row pages, 16 boxes a block,
# spilled 4 bytes at 24).
RAGGED_REGISTER_SPLIT = {1: (56, 240)}
PAGED_REGISTER_SPLIT = {1: (56, 240), 2: (40, 232)}


def register_split(config: FwdConfig, layout: InputLayout | None = None) -> tuple[int, int]:
    """(producer, consumer) registers per thread after setmaxnreg (`layout`: the inputs')."""
    wgs = num_consumer_warpgroups(config)
    split = REGISTER_SPLIT[wgs]
    if layout is not None and layout.paged:
        split = PAGED_REGISTER_SPLIT.get(wgs, split)
    elif layout is not None and layout.ragged:
        split = RAGGED_REGISTER_SPLIT.get(wgs, split)
    return split


def merge_splits_in_flight(
    config: FwdConfig, head_dim_v: int, layout: InputLayout | None = None
) -> int:
    """The in-kernel combine's splits whose partials a consumer thread loads at once (the merge
    loop's unroll): each holds a row of the thread's O fragment (head_dim_v / 4 fp32 registers).
    From ptxas at sm_90a (the compile tests' spread): 4 up to head dim 128 where the consumers
    have 232 registers or more (one or two warpgroups, paged too); else 1: 2 already spilled
    above head dim 128 (64x64 at 256) and with three warpgroups' 160 registers (192x64 at 128)."""
    consumer = register_split(config, layout)[1]
    return 4 if head_dim_v <= 128 and consumer >= 232 else 1


def launch_registers(wgs: int, target: Target) -> int:
    """Registers per thread at launch for a block of `wgs` consumer warpgroups and the producer, one
    block per SM: the register file over the threads, in the allocation unit of 8 per thread."""
    return (
        min(target.max_regs_per_thread, target.regs_per_sm // (THREADS_PER_WARPGROUP * (wgs + 1)))
        // 8
        * 8
    )


def register_split_reasons(
    wgs: int, target: Target, split: tuple[int, int] | None = None
) -> list[str]:
    """Why a register split (default REGISTER_SPLIT[wgs]) cannot work on `target`: the consumers
    would take more registers than the producer gives back, and their setmaxnreg.inc would never
    return. A split that passes keeps the block within the register file too: it holds no more
    than it launched with."""
    producer, consumer = split or REGISTER_SPLIT[wgs]
    launch = launch_registers(wgs, target)
    released, taken = launch - producer, wgs * (consumer - launch)
    if taken > released:
        return [
            f"register split {producer}/{consumer} with {wgs} consumer warpgroups: they launch "
            f"with {launch} registers per thread, and would take {taken} per lane where the "
            f"producer warpgroup gives back {released} (setmaxnreg.inc would wait for ever)"
        ]
    return []


def register_reasons(config: FwdConfig, problem: Problem, target: Target) -> list[str]:
    wgs = num_consumer_warpgroups(config)
    if wgs not in REGISTER_SPLIT:
        return [
            f"tile_m={config.tile_m} gives {wgs} consumer warpgroups; supported: "
            f"{', '.join(str(w * WGMMA_M) for w in REGISTER_SPLIT)}"
        ]
    split = register_split(config, problem.layout)
    _, consumer = split
    # (a balanced split also fits the register file)
    reasons = register_split_reasons(wgs, target, split)
    need = consumer_registers_needed(config, problem)
    if need > min(consumer, target.max_regs_per_thread):
        reasons.append(
            f"consumer threads need about {need} registers (O {problem.head_dim_v}, "
            f"S {config.tile_n}"
            f"{', P for intra-warpgroup overlap' if config.intra_wg_overlap else ''}) "
            f"but get {consumer} with tile_m={config.tile_m}: the kernel would spill"
        )
    return reasons


def tile_reasons(config: FwdConfig, problem: Problem) -> list[str]:
    """wgmma and TMA shape rules."""
    reasons = []
    if config.tile_m % WGMMA_M:
        reasons.append(f"tile_m={config.tile_m} is not a multiple of the wgmma M of {WGMMA_M}")
    # S = Q K^T has N = tile_n; O += P V has K = tile_n (16 per bf16 wgmma) and N = head_dim_v.
    if config.tile_n % 16:
        reasons.append(f"tile_n={config.tile_n} is not a multiple of 16 (the K of the P·V wgmma)")
    if not 16 <= config.tile_n <= 256:
        reasons.append(f"tile_n={config.tile_n} outside the wgmma N range 16..256")
    if problem.head_dim % 16:
        reasons.append(
            f"head_dim={problem.head_dim} is not a multiple of 16 (the K of the Q·K wgmma)"
        )
    if problem.head_dim_v % 8 or problem.head_dim_v > 256:
        reasons.append(f"head_dim_v={problem.head_dim_v} must be a multiple of 8 and at most 256")
    return reasons


def epilogue_reasons(config: FwdConfig) -> list[str]:
    """A single-tile CTA stages O in Q's buffer, which the consumer warpgroups share: only
    persistent CTAs, whose O has a buffer of its own, can store it per warpgroup, or double-buffer Q
    for the next tile."""
    reasons = []
    if config.wg_epilogue and not config.persistent:
        reasons.append(
            "wg_epilogue=True needs persistent=True (a single-tile CTA stores O through Q's "
            "buffer, which all its consumer warpgroups read)"
        )
    if config.q_stages > 1 and not config.persistent:
        reasons.append(
            f"q_stages={config.q_stages} needs persistent=True (a single-tile CTA loads one Q "
            f"and stages O in its buffer)"
        )
    if config.wg_epilogue and num_consumer_warpgroups(config) > 3:
        reasons.append(
            f"wg_epilogue=True is built for at most three consumer warpgroups (its two "
            f"named barriers each sit on ids 8-13, where four take their GEMM turns); "
            f"tile_m={config.tile_m} has {num_consumer_warpgroups(config)}"
        )
    return reasons
