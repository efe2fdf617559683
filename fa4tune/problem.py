"""The problem key: one forward-attention shape, and the bucket that tables are keyed by."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace

DTYPES = ("bf16", "fp16")
# Dtypes of one element width: a config tuned for one runs the other with the same shared memory,
# registers and instruction mix (only the MMA's input type and the conversions of P and O differ),
# so a table of one serves the other where it holds nothing usable of that dtype, head dims and
# causality.
SIBLING_DTYPES = {"bf16": "fp16", "fp16": "bf16"}
# Head dims any fa4tune kernel could ever take; a given kernel may support fewer (its own check says
# so).
HEAD_DIMS = (64, 96, 128, 192, 256)

_DTYPE_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "torch.float16": "fp16",
}


# Problems with at most this many queries per sequence are decode: one new token, a speculative
# draft, a chunked-prefill tail. Their time is the K/V read, not the tensor cores', so their configs
# (packed GQA, split-KV, 64-row tiles) and prefill's never stand in for each other: the regime is
# part of a bucket's family.
DECODE_MAX_SEQLEN_Q = 64


def regime_of(seqlen_q: int) -> str:
    return "decode" if seqlen_q <= DECODE_MAX_SEQLEN_Q else "prefill"


# Page sizes of a paged KV cache the kernels take: powers of two from 8 rows (a shared-memory
# swizzle atom: a page is one or more TMA boxes of whole atoms). Each kernel config takes those
# whose size divides its K/V tile or that its tile divides.
PAGE_SIZES = tuple(2**i for i in range(3, 16))


@dataclass(frozen=True, order=True)
class InputLayout:
    """How a problem's tensors hold their batch (flash-attn-4's varlen arguments): batch-shaped
    (all False/None), or ragged. It decides what a kernel compiles, not only its shapes.

    varlen_q: q is (total_q, nheads_q, d) with cu_seqlens_q; varlen_k: k and v are (total_k,
    nheads_kv, d) with cu_seqlens_k; page_size: k and v are pages (num_pages, page_size, nheads_kv,
    d) with a page_table (0: not paged); seqused_k: each batch uses only its first seqused_k[b]
    keys."""

    varlen_q: bool = False
    varlen_k: bool = False
    page_size: int = 0  # 0: not paged
    seqused_k: bool = False

    @property
    def ragged(self) -> bool:
        return self != InputLayout()

    @property
    def kv_rows(self) -> bool:
        """Whether K and V are read as packed rows with per-batch bounds (varlen, paged, or
        batch-shaped with seqused_k) rather than one batch mode."""
        return self.varlen_k or self.paged or self.seqused_k

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    def stand_in(self, seqlen: int = 4096) -> dict:
        """Problem fields of this layout for a one-batch problem of `seqlen` queries and keys: what
        a compiled kernel's feasibility is checked with (shapes are run-time)."""
        return {
            "seqlen_q": seqlen,
            "seqlen_k": seqlen,
            "batch": 1,
            "total_q": seqlen if self.varlen_q else None,
            "total_k": seqlen if self.varlen_k else None,
            "page_size": self.page_size or None,
            "seqused_k": self.seqused_k,
        }

    def tag(self) -> str:
        """The key suffix: empty for batch-shaped inputs."""
        return (
            ("-vq" if self.varlen_q else "")
            + ("-vk" if self.varlen_k else "")
            + (f"-pg{self.page_size}" if self.paged else "")
            + ("-su" if self.seqused_k else "")
        )


class ProblemError(ValueError):
    """A problem description that no attention kernel can take."""


def normalize_dtype(dtype: object) -> str:
    key = str(dtype).lower()
    if key not in _DTYPE_ALIASES:
        raise ProblemError(f"unsupported dtype {dtype!r}: fa4tune kernels take {', '.join(DTYPES)}")
    return _DTYPE_ALIASES[key]


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class Problem:
    """One attention forward problem: O = softmax(scale * Q K^T [+ causal mask]) V.

    q is (batch, seqlen_q, nheads_q, head_dim); k and v are (batch, seqlen_k, nheads_kv,
    head_dim[_v]).

    Ragged inputs (flash-attn-4's varlen and paged calls) keep the same fields with seqlen_q and
    seqlen_k the longest sequence's (max_seqlen_q, max_seqlen_k) and batch the number of sequences,
    and add what a caller knows without reading the device: total_q, the rows of q (total_q,
    nheads_q, d) when it is packed (cu_seqlens_q); total_k, the rows of k and v when they are packed
    (cu_seqlens_k); page_size, when k and v are pages of a paged cache; seqused_k, whether each
    batch uses only its first seqused_k[b] keys. docs/serving.md says how a call forms them.
    """

    dtype: str = "bf16"
    head_dim: int = 128
    head_dim_v: int | None = None
    causal: bool = False
    seqlen_q: int = 4096
    seqlen_k: int | None = None
    batch: int = 1
    nheads_q: int = 16
    nheads_kv: int | None = None
    total_q: int | None = None
    total_k: int | None = None
    page_size: int | None = None
    seqused_k: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "dtype", normalize_dtype(self.dtype))
        if self.head_dim_v is None:
            set_(self, "head_dim_v", self.head_dim)
        if self.seqlen_k is None:
            set_(self, "seqlen_k", self.seqlen_q)
        if self.nheads_kv is None:
            set_(self, "nheads_kv", self.nheads_q)
        for name in (
            "head_dim",
            "head_dim_v",
            "seqlen_q",
            "seqlen_k",
            "batch",
            "nheads_q",
            "nheads_kv",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ProblemError(f"{name} must be an integer, got {value!r}")
            if value <= 0:
                raise ProblemError(f"{name} must be positive, got {value}")
        if not isinstance(self.causal, bool):
            raise ProblemError(f"causal must be true or false, got {self.causal!r}")
        for name in ("head_dim", "head_dim_v"):
            if getattr(self, name) not in HEAD_DIMS:
                raise ProblemError(
                    f"unsupported {name} {getattr(self, name)}: supported head dims are "
                    f"{', '.join(map(str, HEAD_DIMS))}"
                )
        if self.nheads_q % self.nheads_kv:
            raise ProblemError(
                f"nheads_q ({self.nheads_q}) must be a multiple of nheads_kv ({self.nheads_kv}) "
                "for grouped-query attention"
            )
        self._check_ragged()

    def _check_ragged(self) -> None:
        for name in ("total_q", "total_k", "page_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ProblemError(f"{name} must be an integer or absent, got {value!r}")
        if not isinstance(self.seqused_k, bool):
            raise ProblemError(f"seqused_k must be true or false, got {self.seqused_k!r}")
        for name, longest, field in (
            ("total_q", self.seqlen_q, "seqlen_q"),
            ("total_k", self.seqlen_k, "seqlen_k"),
        ):
            total = getattr(self, name)
            if total is None:
                continue
            # The longest sequence is one of `batch`: the total holds it and at most batch of them.
            if not longest <= total <= self.batch * longest:
                raise ProblemError(
                    f"{name} ({total}) must lie between {field} ({longest}, the longest sequence) "
                    f"and batch x {field} ({self.batch * longest})"
                )
        if self.page_size is not None:
            if self.total_k is not None:
                raise ProblemError("give total_k (packed K and V) or page_size (paged), not both")
            if self.page_size not in PAGE_SIZES:
                raise ProblemError(
                    f"unsupported page_size {self.page_size}: pages of a power of two from "
                    f"{PAGE_SIZES[0]} to {PAGE_SIZES[-1]} rows are supported"
                )

    # ---- derived quantities -------------------------------------------------------------------
    @property
    def qheads_per_kvhead(self) -> int:
        return self.nheads_q // self.nheads_kv

    @property
    def regime(self) -> str:
        """ "decode" (seqlen_q at most DECODE_MAX_SEQLEN_Q) or "prefill"."""
        return regime_of(self.seqlen_q)

    @property
    def layout(self) -> InputLayout:
        """How the tensors hold the batch: batch-shaped or ragged (InputLayout)."""
        return InputLayout(
            self.total_q is not None, self.total_k is not None, self.page_size or 0, self.seqused_k
        )

    def lengths(self) -> list[tuple[int, int]]:
        """(queries, keys) of each sequence: seqlen_q and seqlen_k for every batch when the inputs
        are batch-shaped, else the token mix a ragged problem is measured on (fa4tune.mixes)."""
        if not self.layout.ragged:
            return [(self.seqlen_q, self.seqlen_k)] * self.batch
        from .mixes import sequence_lengths

        return list(zip(*sequence_lengths(self)))

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V: what a decode call reads at the least (its effective rate: these over
        its time); of the token mix for ragged inputs."""
        keys = sum(k for _, k in self.lengths())
        return 2 * keys * self.nheads_kv * (self.head_dim + self.head_dim_v)

    @property
    def flops(self) -> float:
        """Forward FLOPs by the usual convention: 2 GEMMs of 2·s_q·s_k·d each, halved for causal;
        summed over the sequences (the token mix of ragged inputs).

        With seqlen_q != seqlen_k and causal (aligned bottom-right) the exact count of unmasked
        scores is used instead of the half.
        """
        d = (self.head_dim + self.head_dim_v) / 2

        def pairs(sq: int, sk: int) -> int:
            return causal_pairs(sq, sk) if self.causal else sq * sk

        if self.layout.ragged:
            total = sum(pairs(sq, sk) for sq, sk in self.lengths())
        else:
            total = self.batch * pairs(self.seqlen_q, self.seqlen_k)
        return 4.0 * self.nheads_q * total * d

    @property
    def bytes_min(self) -> int:
        """Fewest bytes moved through HBM: q, k, v read once, o written once, lse written once (of
        the token mix for ragged inputs)."""
        elt = 2
        lengths = self.lengths()
        queries, keys = sum(q for q, _ in lengths), sum(k for _, k in lengths)
        q = queries * self.nheads_q * self.head_dim
        k = keys * self.nheads_kv * self.head_dim
        v = keys * self.nheads_kv * self.head_dim_v
        o = queries * self.nheads_q * self.head_dim_v
        return elt * (q + k + v + o) + 4 * self.nheads_q * queries

    # ---- keys ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The problem's fields; the ragged ones only when set, so that a batch-shaped problem is
        stored as before they existed."""
        data = asdict(self)
        for name in ("total_q", "total_k", "page_size"):
            if data[name] is None:
                del data[name]
        if not data["seqused_k"]:
            del data["seqused_k"]
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Problem:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ProblemError(
                f"unknown problem field(s) {', '.join(unknown)}; known fields: "
                f"{', '.join(sorted(known))}"
            )
        return cls(**data)

    @classmethod
    def from_job_fields(cls, fields: dict) -> Problem:
        """A Problem from a job file's fields; `tokens` sets batch = tokens / seqlen_q and `hidden`
        sets nheads_q = hidden / head_dim (the design notes' grid: 16k tokens, hidden 2048)."""
        fields = dict(fields)
        tokens, hidden = fields.pop("tokens", None), fields.pop("hidden", None)
        if tokens is not None:
            seqlen = fields.get("seqlen_q", 4096)
            if "batch" in fields:
                raise ProblemError("give either tokens or batch, not both")
            if (
                not isinstance(tokens, int)
                or not isinstance(seqlen, int)
                or tokens % seqlen
                or tokens < seqlen
            ):
                raise ProblemError(
                    f"tokens ({tokens!r}) must be a multiple of seqlen_q ({seqlen!r})"
                )
            fields["batch"] = tokens // seqlen
        if hidden is not None:
            head_dim = fields.get("head_dim", 128)
            if "nheads_q" in fields:
                raise ProblemError("give either hidden or nheads_q, not both")
            if not isinstance(hidden, int) or not isinstance(head_dim, int) or hidden % head_dim:
                raise ProblemError(
                    f"hidden ({hidden!r}) must be a multiple of head_dim ({head_dim!r})"
                )
            fields["nheads_q"] = hidden // head_dim
        try:
            return cls.from_dict(fields)
        except TypeError as exc:
            raise ProblemError(str(exc)) from exc

    def key(self) -> str:
        """A stable, readable string key of the exact problem."""
        c = "causal" if self.causal else "full"
        totals = (f"-tq{self.total_q}" if self.total_q is not None else "") + (
            f"-tk{self.total_k}" if self.total_k is not None else ""
        )
        return (
            f"{self.dtype}-d{self.head_dim}x{self.head_dim_v}-{c}-q{self.seqlen_q}-k{self.seqlen_k}"
            f"-b{self.batch}-h{self.nheads_q}x{self.nheads_kv}{totals}"
            f"{'-pg' + str(self.page_size) if self.page_size is not None else ''}"
            f"{'-su' if self.seqused_k else ''}"
        )

    def lent_to(self, problem: Problem) -> tuple[Problem, bool] | None:
        """This tuned problem as a lender of its config to `problem` (the runtime lookup, the
        search's warm start): (itself, False) in problem's dtype; (itself in problem's dtype, True)
        when its dtype is the sibling (SIBLING_DTYPES); None when it cannot lend. Head dims and
        causality are still the distance's to judge."""
        if self.dtype == problem.dtype:
            return self, False
        if self.dtype == SIBLING_DTYPES.get(problem.dtype):
            return replace(self, dtype=problem.dtype), True
        return None

    def bucket(self) -> Bucket:
        return Bucket.of(self)

    def distance(self, other: Problem) -> float:
        """Bucket.distance on the exact sizes: how close two problems of one bucket are."""
        if self.bucket().family() != other.bucket().family():
            return math.inf
        return _size_distance(
            (self.seqlen_q, self.seqlen_k, self.batch * self.nheads_q, self.qheads_per_kvhead),
            (other.seqlen_q, other.seqlen_k, other.batch * other.nheads_q, other.qheads_per_kvhead),
        ) + _layout_distance(self.layout, other.layout)

    def compile_key(self) -> tuple:
        """What a compiled kernel depends on, beyond its config (shapes are run-time)."""
        key = (self.dtype, self.head_dim, self.head_dim_v, self.causal)
        return key + ((self.layout,) if self.layout.ragged else ())


def causal_pairs(seqlen_q: int, seqlen_k: int) -> int:
    """Number of unmasked (i, j): row i sees keys j <= i + seqlen_k - seqlen_q
    (bottom-right aligned)."""
    offset = seqlen_k - seqlen_q
    # Row i sees clamp(i + offset + 1, 0, seqlen_k) keys: zero up to row `lo`, growing by one per
    # row up to row `hi`, then all seqlen_k keys.
    lo = min(seqlen_q, max(0, -offset))
    hi = min(seqlen_q, max(lo, seqlen_k - offset - 1))
    first, last = lo + offset + 1, (hi - 1) + offset + 1
    ramp = (first + last) * (hi - lo) // 2 if hi > lo else 0
    return ramp + (seqlen_q - hi) * seqlen_k


@dataclass(frozen=True, order=True)
class Bucket:
    """Problems that share a tuned config: same dtype, head dims and causality, with seqlens rounded
    up to powers of two and batch·heads rounded up to a power of two, and the GQA ratio kept."""

    dtype: str
    head_dim: int
    head_dim_v: int
    causal: bool
    seqlen_q: int
    seqlen_k: int
    batch_heads: int
    qheads_per_kvhead: int
    # Ragged inputs: how the tensors hold the batch, and the packed query rows rounded up to a
    # power of two (0 when q is batch-shaped). Batch-shaped problems keep the defaults.
    layout: InputLayout = InputLayout()
    tokens_q: int = 0

    @classmethod
    def of(cls, p: Problem) -> Bucket:
        return cls(
            dtype=p.dtype,
            head_dim=p.head_dim,
            head_dim_v=p.head_dim_v,
            causal=p.causal,
            seqlen_q=_pow2_ceil(p.seqlen_q),
            seqlen_k=_pow2_ceil(p.seqlen_k),
            batch_heads=_pow2_ceil(p.batch * p.nheads_q),
            qheads_per_kvhead=p.qheads_per_kvhead,
            layout=p.layout,
            tokens_q=_pow2_ceil(p.total_q) if p.total_q is not None else 0,
        )

    def key(self) -> str:
        c = "causal" if self.causal else "full"
        return (
            f"{self.dtype}-d{self.head_dim}x{self.head_dim_v}-{c}-q{self.seqlen_q}-k{self.seqlen_k}"
            f"-bh{self.batch_heads}-g{self.qheads_per_kvhead}"
            f"{f'-tq{self.tokens_q}' if self.tokens_q else ''}{self.layout.tag()}"
        )

    @property
    def regime(self) -> str:
        return regime_of(self.seqlen_q)  # seqlen_q's power of two: 64 stays decode, 65 is 128

    def family(self) -> tuple:
        """What two problems must share for one's config to be borrowed by the other: dtype, head
        dims, causality and regime (decode and prefill configs are tuned apart)."""
        return (self.dtype, self.head_dim, self.head_dim_v, self.causal, self.regime)

    def distance(self, other: Bucket) -> float:
        """Distance in log2 seqlen and log2 batch·heads (infinite across families)."""
        if self.family() != other.family():
            return math.inf
        return _size_distance(
            (self.seqlen_q, self.seqlen_k, self.batch_heads, self.qheads_per_kvhead),
            (other.seqlen_q, other.seqlen_k, other.batch_heads, other.qheads_per_kvhead),
        ) + _layout_distance(self.layout, other.layout)


# A config tuned for another layout runs, where the rules let it, but its tuning saw other loads (a
# sequence's bounds) and another schedule: it lends only where no problem of the same layout is as
# near (the weight of doubling both seqlens). A paged cache and contiguous K/V never lend to each
# other: a page's TMA boxes and the page table change the loads, and the tiles a page size allows
# rule out the nearest dense configs, so the loan fell to a far one (on the H200, paged decode at
# batch 1 / 131k took 0.77x the default's speed from a dense table; docs/kernel-notes.md).
LAYOUT_DISTANCE = 2.0


def _layout_distance(a: InputLayout, b: InputLayout) -> float:
    if a.paged != b.paged:
        return math.inf
    return 0.0 if a == b else LAYOUT_DISTANCE


_SIZE_WEIGHTS = (1.0, 1.0, 0.5, 0.25)  # seqlen_q, seqlen_k, batch·heads, q heads per kv head


def _size_distance(a: tuple, b: tuple) -> float:
    """Weighted distance in log2 of (seqlen_q, seqlen_k, batch·heads, q heads per kv head)."""
    return sum(w * abs(math.log2(x) - math.log2(y)) for w, x, y in zip(_SIZE_WEIGHTS, a, b))
