"""The compile-time knobs of the Hopper forward kernel: one schema, its legal values, its defaults
and its feasibility rules (shared with the search-space plugins)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

from ...problem import Problem
from ...target import Target
from ..family import Rule
from ..sm90 import exp2_poly
from . import resources


class ConfigError(ValueError):
    """A config that names unknown knobs, holds illegal values, or cannot be built for a problem."""


# Split-KV: how many CTAs share the keys of one tile (1: no split). One compiled kernel serves every
# count above 1 (the count is the partial outputs' extent, read at run time).
SPLIT_COUNTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)

# The full domain of every knob. Search spaces pick from these; anything else is refused.
KNOBS: dict[str, tuple] = {
    "tile_m": (64, 128, 192, 256),
    "tile_n": (64, 80, 96, 112, 128, 144, 160, 176, 192),
    "num_stages": (1, 2, 3, 4, 5),
    "poly_degree": (1, 2, 3, 4, 5),
    "emu_share": (0.0, 0.125, 0.25, 0.375, 0.5),
    "rescale_threshold": (0.0, 2.0, 4.0, 8.0),
    "intra_wg_overlap": (True, False),
    "wg_pingpong": (True, False),
    "rescale_branch": (True, False),
    "persistent": (False, True),
    "wg_epilogue": (False, True),
    "q_stages": (1, 2),
    "lazy_max": (False, True),
    "pack_gqa": (False, True),
    "num_splits": SPLIT_COUNTS,
    "combine_in_kernel": (False, True),
}

KERNEL_ARCHS = ("sm_90a",)
SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)


@dataclass(frozen=True)
class FwdConfig:
    """Compile-time knobs of the forward kernel.

    tile_m: rows of Q per CTA, 64 per consumer warpgroup.  tile_n: K/V rows per main-loop step.
    num_stages: depth of the K/V TMA pipeline.  poly_degree: degree of the software exp2.
    emu_share: share of each row's exponentials computed on the FMA pipe instead of the MUFU.
    rescale_threshold: O and the row sum are rescaled only when the row max rose by more than this
    (log2 units); 0 rescales on every rise.  intra_wg_overlap: issue the next S GEMM before the
    current softmax.  wg_pingpong: order the consumer warpgroups' GEMMs with named barriers so that
    one warpgroup's softmax overlaps the other's GEMMs.  rescale_branch: a warp skips the O rescale
    (a vote and a branch) when none of its rows moved its max; otherwise O is always multiplied.
    persistent: one CTA per SM walks the tiles, loading the next tile while it finishes this
    one (O then needs its own shared-memory buffer); causal tiles come from a global counter,
    longest first.
    wg_epilogue: (persistent only) each consumer warpgroup stores its own rows of O through a buffer
    of its own as soon as its main loop is done, without waiting for the other warpgroups.
    q_stages: (persistent only) Q buffers in shared memory; with 2 the producer loads the next
    tile's Q as soon as it has issued this tile's last K/V loads, while this tile's S GEMMs still
    read the other buffer, instead of after the last of them.
    lazy_max: after a tile's first K/V block, exponentiate against the running max without first
    taking the block's row max; the row sums show when a row's max rose past the threshold, and only
    then is the max taken (from P) and O rescaled. A rise too large to rescale by (past 125 in log2
    units, or a P or row sum overflowed) makes the warp recompute its scores from shared memory and
    take the exact step. Needs rescale_threshold 8 and no emulation (lazy_max_reasons).
    pack_gqa: the query heads that share a K/V head go through one tile as its rows (row r is
    query r // group of head r % group), so each K/V block is read once per K/V head, not once per
    query head; the group size is compiled in (it must divide tile_m).
    num_splits: split-KV. The K blocks of each tile are divided among this many CTAs, which write
    fp32 partial O and LSE to a workspace; a combine kernel (combine.py) merges them into O and
    LSE with the unsplit kernel's meaning. Not persistent (the grid is tiles x splits).
    combine_in_kernel: (split only) no combine kernel: each split CTA counts itself in at a
    per-tile counter once its partials are written, and the tile's last CTA merges the partials
    into O and LSE (the combine kernel's meaning and summation order) and puts the counter back to
    zero. One launch instead of two.
    """

    tile_m: int = 128
    tile_n: int = 128
    num_stages: int = 2
    poly_degree: int = 3
    emu_share: float = 0.0
    rescale_threshold: float = 0.0
    intra_wg_overlap: bool = True
    wg_pingpong: bool = True
    rescale_branch: bool = True
    persistent: bool = False
    wg_epilogue: bool = False
    q_stages: int = 1
    lazy_max: bool = False
    pack_gqa: bool = False
    num_splits: int = 1
    combine_in_kernel: bool = False

    def __post_init__(self) -> None:
        bad = []
        for f in fields(self):
            value = getattr(self, f.name)
            legal = KNOBS[f.name]
            # bools are ints in Python: keep True/False apart from 1/0 for the integer knobs.
            same_kind = isinstance(value, bool) == isinstance(legal[0], bool)
            if not same_kind or value not in legal:
                bad.append(f"{f.name}={value!r} (legal: {', '.join(map(repr, legal))})")
        if bad:
            raise ConfigError("illegal knob value(s): " + "; ".join(bad))
        # Store floats as floats so that equal configs hash and serialise alike.
        object.__setattr__(self, "emu_share", float(self.emu_share))
        object.__setattr__(self, "rescale_threshold", float(self.rescale_threshold))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, base: FwdConfig | None = None) -> FwdConfig:
        """Build a config from knob values; the others come from `base` (or the class defaults)."""
        unknown = sorted(set(data) - set(KNOBS))
        if unknown:
            raise ConfigError(
                f"unknown knob(s) {', '.join(unknown)}; known knobs: {', '.join(KNOBS)}"
            )
        values = dict(data)
        for name in ("tile_m", "tile_n", "num_stages", "poly_degree", "q_stages", "num_splits"):
            if name in values and isinstance(values[name], float) and values[name].is_integer():
                values[name] = int(values[name])  # YAML / JSON round trips may give 128.0
        return replace(base, **values) if base is not None else cls(**values)

    def canonical(self) -> FwdConfig:
        """The same kernel with knobs that have no effect set to their defaults, so that two configs
        that compile to the same code compare equal (poly_degree is unused without emulation, the
        ping-pong order with one consumer warpgroup)."""
        config = self
        if config.emu_share == 0.0 and config.poly_degree != FwdConfig.poly_degree:
            config = replace(config, poly_degree=FwdConfig.poly_degree)
        if config.tile_m == 64 and config.wg_pingpong != FwdConfig.wg_pingpong:
            config = replace(config, wg_pingpong=FwdConfig.wg_pingpong)  # one warpgroup: no turns
        return config

    def uses_tile_counter(self, causal: bool) -> bool:
        """Whether the kernel's CTAs take their tiles from the global tile counter: persistent
        causal CTAs do (their tiles differ in length); every other kernel ignores the counter."""
        return self.persistent and bool(causal)

    def short(self) -> str:
        return (
            f"{self.tile_m}x{self.tile_n}s{self.num_stages}"
            f"-e{self.emu_share:g}p{self.poly_degree}-r{self.rescale_threshold:g}"
            f"{'-ov' if self.intra_wg_overlap else ''}{'-pp' if self.wg_pingpong else ''}"
            f"{'' if self.rescale_branch else '-rm'}{'-ps' if self.persistent else ''}"
            f"{'-we' if self.wg_epilogue else ''}"
            f"{f'-q{self.q_stages}' if self.q_stages > 1 else ''}{'-lm' if self.lazy_max else ''}"
            f"{'-pg' if self.pack_gqa else ''}"
            f"{f'-sp{self.num_splits}' if self.num_splits > 1 else ''}"
            f"{'-ck' if self.combine_in_kernel else ''}"
        )

    @property
    def split(self) -> bool:
        """Whether the kernel writes partials for the combine kernel (num_splits above 1)."""
        return self.num_splits > 1


def unsupported_reasons(problem: Problem, target: Target) -> list[str]:
    """Why this kernel cannot take the problem at all, whatever the config."""
    reasons = []
    if target.arch not in KERNEL_ARCHS:
        reasons.append(
            f"the fa4 forward kernel is built for {', '.join(KERNEL_ARCHS)}; "
            f"target {target.name} is {target.arch}"
        )
    for name in ("head_dim", "head_dim_v"):
        value = getattr(problem, name)
        if value not in SUPPORTED_HEAD_DIMS:
            reasons.append(
                f"{name}={value} not supported (supported: "
                f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))})"
            )
    return reasons


MAX_GRID_YZ = 65535  # CUDA's limit on a grid's y and z extents


def grid_reasons(config: FwdConfig, problem: Problem) -> list[str]:
    """Why the launch grid cannot hold the problem. One CTA per tile without causality, and every
    split kernel, launches a (m blocks [x splits], heads, batch) grid, whose y and z extents CUDA
    caps; the other launches are flat. Packed GQA tiles are per K/V head."""
    if config.persistent or (problem.causal and not config.split):
        return []
    heads = problem.nheads_kv if config.pack_gqa else problem.nheads_q
    return [
        f"{name} {value} > {MAX_GRID_YZ} (the grid's {axis} extent with one CTA per tile)"
        for name, value, axis in (("heads", heads, "y"), ("batch", problem.batch, "z"))
        if value > MAX_GRID_YZ
    ]


def pack_reasons(config: FwdConfig, problem: Problem) -> list[str]:
    """Why packed GQA cannot take this config: a tile's rows are whole groups of query heads (the
    TMA box of Q and O is (group, tile_m / group) over (head, query)), so the group must divide
    tile_m; one query head per K/V head has nothing to pack."""
    if not config.pack_gqa:
        return []
    group = problem.qheads_per_kvhead
    if group == 1:
        return ["pack_gqa=True with one query head per K/V head: there is nothing to pack"]
    if config.tile_m % group:
        return [
            f"pack_gqa=True with {group} query heads per K/V head: the group must divide "
            f"tile_m={config.tile_m}"
        ]
    return []


def split_reasons(config: FwdConfig) -> list[str]:
    """Why split-KV cannot take this config: a split CTA has one tile (the grid is tiles x
    splits)."""
    if config.split and config.persistent:
        return [
            f"num_splits={config.num_splits} needs persistent=False (split CTAs take one tile "
            "each, from a grid of tiles x splits)"
        ]
    return []


def combine_reasons(config: FwdConfig, problem: Problem) -> list[str]:
    """Why the in-kernel combine cannot take this config: it merges the splits of a tile, so without
    splits there is nothing to merge (refused rather than ignored, so that the search does not
    measure one kernel under two names); and its last CTA writes the tile's rows of batch-shaped O
    and LSE (varlen Q's rows are not built: the combine kernel takes them)."""
    if not config.combine_in_kernel:
        return []
    if not config.split:
        return ["combine_in_kernel=True needs num_splits > 1 (it merges a tile's splits)"]
    if problem.layout.varlen_q:
        return [
            "combine_in_kernel=True with varlen Q (cu_seqlens_q): the last CTA writes batch-shaped "
            "O only; the combine kernel takes varlen rows"
        ]
    return []


def ragged_reasons(config: FwdConfig, problem: Problem) -> list[str]:
    """Why ragged inputs (varlen, paged, seqused_k) cannot take this config. Their CTAs take one
    tile each: a persistent CTA walks a grid of tiles that batch-shaped Q fixes, and its tile
    counter orders them by a length that every batch shares. A paged K/V block is loaded as whole
    TMA boxes of one page each, so a page must divide the block or the block the page."""
    layout = problem.layout
    reasons = []
    if layout.ragged and config.persistent:
        reasons.append(
            "persistent=True with ragged inputs (varlen, paged or seqused_k): their CTAs take one "
            "tile each"
        )
    if layout.paged and config.tile_n % layout.page_size and layout.page_size % config.tile_n:
        reasons.append(
            f"tile_n={config.tile_n} with {layout.page_size}-row pages: a page must divide the K/V "
            "block or the block the page"
        )
    return reasons


def ragged_default(config: FwdConfig, problem: Problem) -> FwdConfig:
    """A prefill default made fit for ragged inputs (ragged_reasons): one tile per CTA, and with
    pages the widest K/V block, no wider than the config's, that pages divide or that divides a
    page."""
    config = replace(config, persistent=False, wg_epilogue=False, q_stages=1)
    page = problem.layout.page_size
    if page and config.tile_n % page and page % config.tile_n:
        fits = [
            n for n in KNOBS["tile_n"] if n <= config.tile_n and (n % page == 0 or page % n == 0)
        ]
        config = replace(config, tile_n=max(fits))
    return config


def lazy_max_reasons(config: FwdConfig) -> list[str]:
    """Why the lazy row max cannot take this config. Each thread sums tile_n / 4 of a row's P, each
    1 where the score equals the max; the fast path holds while every such sum stays within
    2^rescale_threshold, so that limit must be at least twice the sum of a row of equal scores, or
    rows of equal scores take the slow path at every block. And the lazy step exponentiates scores
    up to the whole rise over the running max, past 127 in log2 units, where the emulated exp2 is
    wrong (its exponent wraps into the sign: negative P, or NaN), so it takes the MUFU only."""
    if not config.lazy_max:
        return []
    reasons = []
    if 2.0**config.rescale_threshold < config.tile_n / 2:
        reasons.append(
            f"lazy_max with rescale_threshold {config.rescale_threshold:g} would take the row max "
            f"at every block of equal scores (a thread's row sum is then tile_n/4 = "
            f"{config.tile_n // 4}, the limit 2^threshold must be at least twice that: "
            f"rescale_threshold >= {math.log2(config.tile_n / 2):.2f})"
        )
    if config.emu_share > 0:
        reasons.append(
            f"lazy_max with emu_share {config.emu_share:g}: the lazy step exponentiates the "
            f"whole rise of a row's scores, and the emulated exp2 holds only up to 2^127"
        )
    return reasons


def decode_rescale_reasons(config: FwdConfig, problem: Problem) -> list[str]:
    """Why the search and the decode default pass over the lazy rescale on a decode problem (the
    family's avoid_reasons; the kernel runs it right). With the running max stale by up to
    2^rescale_threshold the heaviest probabilities no longer sit just under 1.0, at the top of a
    bf16 binade where P's rounding is relatively finest: on the H200 decode's O error rose to
    1.04-1.17x flash-attn-4's, against its output bit for bit with threshold 0
    (docs/kernel-notes.md, session 38). Decode is memory-bound: the skipped rescales buy it
    nothing."""
    if problem.regime == "decode" and config.rescale_threshold > 0:
        return [
            f"rescale_threshold {config.rescale_threshold:g} on a decode problem (seqlen_q "
            f"{problem.seqlen_q}): the lazy rescale raises its output error (up to 1.17x exact "
            "rescaling's) for no speed; decode takes rescale_threshold 0"
        ]
    return []


# The kernel's feasibility rules: the search spaces refuse a config by them before anything
# compiles, and the kernel's constructor refuses the same configs with the same reasons.
RULES = (
    Rule("launch grid", lambda problem, config, target: grid_reasons(config, problem)),
    Rule(
        "wgmma and TMA shapes",
        lambda problem, config, target: resources.tile_reasons(config, problem),
    ),
    Rule("epilogue", lambda problem, config, target: resources.epilogue_reasons(config)),
    Rule(
        "shared memory",
        lambda problem, config, target: resources.smem_reasons(config, problem, target),
    ),
    Rule(
        "registers",
        lambda problem, config, target: resources.register_reasons(config, problem, target),
    ),
    Rule(
        "exp2 accuracy",
        lambda problem, config, target: exp2_poly.accuracy_reasons(
            config.poly_degree, config.emu_share, problem.dtype
        ),
    ),
    Rule("lazy row max", lambda problem, config, target: lazy_max_reasons(config)),
    Rule("packed GQA", lambda problem, config, target: pack_reasons(config, problem)),
    Rule("split-KV", lambda problem, config, target: split_reasons(config)),
    Rule("in-kernel combine", lambda problem, config, target: combine_reasons(config, problem)),
    Rule("ragged inputs", lambda problem, config, target: ragged_reasons(config, problem)),
)


# ---- the decode default -------------------------------------------------------------------------
# Split-KV's default count (the search measures others): a wave-efficiency rule. Without splits a
# decode launch has one CTA per tile, batch x heads x m blocks of them, and one CTA per SM fits (the
# block launches with the registers of one block per SM). When those tiles already fill
# UNSPLIT_FILL of the SMs they are not split: more CTAs would only add the partials' round trip and
# the combine. Otherwise each count s gives tiles x s CTAs in ceil(tiles x s / SMs) waves, the last
# one (tiles x s / SMs) mod 1 full; the default is the fewest splits whose waves are at least
# WAVE_SLACK as full as the fullest count's, among the counts that leave every split at least
# MIN_BLOCKS_PER_SPLIT K blocks (below that, a CTA's start-up, its Q load and its first K block's
# latency, is not hidden behind its loads). Measured on the H200 (docs/kernel-notes.md, session 34):
# batch 8 x 8 K/V heads x 32k keys, 64 tiles: 2 splits 4.17 TB/s against 3.96 unsplit; batch 64 x
# 8 x 4k, 512 tiles: unsplit 4.13 against 4.08 with 2; batch 1 x 8 x 131k: 16 splits 3.77 against
# 0.55 unsplit.
UNSPLIT_FILL = 0.8
WAVE_SLACK = 0.85
MIN_BLOCKS_PER_SPLIT = 4


def tile_count(config: FwdConfig, problem: Problem) -> int:
    """CTAs of an unsplit, non-persistent launch: batch x heads x m blocks (packed GQA: K/V heads,
    each with group x seqlen_q rows)."""
    group = problem.qheads_per_kvhead if config.pack_gqa else 1
    heads = problem.nheads_q // group
    rows = problem.seqlen_q * group
    return problem.batch * heads * (-(-rows // config.tile_m))


def default_num_splits(config: FwdConfig, problem: Problem, target: Target) -> int:
    """The split count of the wave-efficiency rule above, for `config`'s tiles."""
    tiles, slots = tile_count(config, problem), target.sm_count
    if tiles >= UNSPLIT_FILL * slots:
        return 1
    blocks = -(-problem.seqlen_k // config.tile_n)
    candidates = [s for s in SPLIT_COUNTS if s == 1 or -(-blocks // s) >= MIN_BLOCKS_PER_SPLIT]
    fill = {s: tiles * s / slots / math.ceil(tiles * s / slots) for s in candidates}
    best = max(fill.values())
    return min(s for s in candidates if fill[s] >= WAVE_SLACK * best)


# Stage counts the decode default tries, deepest first: a decode CTA has little to compute per
# block, so keeping more K/V loads in flight is what its shared memory is best spent on.
DECODE_STAGES = (4, 3, 2, 1)


def decode_default(problem: Problem, target: Target) -> FwdConfig:
    """The hand-picked decode config (seqlen_q at most DECODE_MAX_SEQLEN_Q; the search measures
    from here): the query heads of a K/V head packed into one tile when the group divides it, 64
    rows (one consumer warpgroup) when the packed rows fit, else 128; 128 keys per block with the
    deepest pipeline that fits; not persistent (split kernels cannot be); exact rescaling (so
    no lazy max, which needs a threshold: decode_rescale_reasons); and the split count of
    default_num_splits."""
    group = problem.qheads_per_kvhead
    pack = group > 1
    rows = problem.seqlen_q * (group if pack else 1)
    tile_m = 64 if rows <= 64 else 128
    if pack and tile_m % group:
        tile_m = 128 if 128 % group == 0 else tile_m
        pack = tile_m % group == 0
    fallback = None
    for stages in DECODE_STAGES:
        config = FwdConfig(
            tile_m=tile_m,
            tile_n=128 if max(problem.head_dim, problem.head_dim_v) <= 128 else 64,
            num_stages=stages,
            rescale_threshold=0.0,  # exact rescaling: decode_rescale_reasons
            persistent=False,
            pack_gqa=pack,
        )
        config = replace(config, num_splits=default_num_splits(config, problem, target))
        fallback = fallback or config
        if not any(rule.check(problem, config, target) for rule in RULES):
            return config
    return fallback  # nothing fits: the caller reports the reasons (infeasible_reasons)
