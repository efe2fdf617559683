"""The ragged calls of attention (flash-attn-4's varlen and paged layouts): their checks, the
Problem a call makes, and its outputs. Shared by the attention families and the dispatcher; every
check but the device runs on CPU and meta tensors too, and none reads a tensor's values (the call
stays free of device syncs, and CUDA-graph capturable).

    q:  (total_q, nheads_q, d) with cu_seqlens_q (batch + 1,), or (batch, seqlen_q, nheads_q, d)
    k:  (total_k, nheads_kv, d) with cu_seqlens_k (batch + 1,),
        or pages (num_pages, page_size, nheads_kv, d) with page_table (batch, max_pages),
        or (batch, seqlen_k, nheads_kv, d); v likewise with head_dim_v
    seqused_k: (batch,), each batch's keys are only its first seqused_k[b]
    out: like q with head_dim_v;  lse: (nheads_q, total_q), or (batch, nheads_q, seqlen_q)

The problem key (docs/serving.md): batch is the number of sequences; seqlen_q and seqlen_k are the
caller's max_seqlen_q and max_seqlen_k rounded up to a power of two (so that a decode step's one
more key keeps the key), brought into what the tensors allow, else the most the tensors allow
(total_q, total_k, max_pages x page_size, or the batch-shaped extent); total_q and total_k are the
packed rows of q and of k; page_size and seqused_k say whether they are given. The maximums only
choose the tuned config: a wrong one costs speed, never correctness."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from ...errors import UnsupportedInput
from ...problem import PAGE_SIZES, Problem, ProblemError
from .inputs import batch_output_shapes, check_dense, check_elements, check_heads, check_strides

_INDEX_NAMES = ("cu_seqlens_q", "cu_seqlens_k", "seqused_k", "page_table")


@dataclass(frozen=True)
class Ragged:
    """The index tensors of a ragged call (each None where that input is batch-shaped) and the
    caller's maximums (None: not given)."""

    cu_seqlens_q: object = None
    cu_seqlens_k: object = None
    seqused_k: object = None
    page_table: object = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None

    def tensors(self) -> list:
        """The index tensors present, in the kernel's argument order."""
        every = (self.cu_seqlens_q, self.cu_seqlens_k, self.seqused_k, self.page_table)
        return [t for t in every if t is not None]

    @property
    def varlen_q(self) -> bool:
        return self.cu_seqlens_q is not None

    @property
    def varlen_k(self) -> bool:
        return self.cu_seqlens_k is not None

    @property
    def paged(self) -> bool:
        return self.page_table is not None


def _check_index(name: str, t, shape: tuple) -> None:
    """An int32 index tensor of `shape` (None entries: any extent), contiguous in its last dim."""
    import torch

    check_dense(name, t, "attention_varlen")
    if t.dtype != torch.int32:
        raise UnsupportedInput(
            f"{name} must be torch.int32 (as flash-attn-4 takes it); it is {t.dtype} "
            f"(use {name}.to(torch.int32))"
        )
    if t.dim() != len(shape) or any(w is not None and s != w for s, w in zip(t.shape, shape)):
        want = tuple("any" if w is None else w for w in shape)
        raise UnsupportedInput(f"{name} must have shape {want}; it has {tuple(t.shape)}")
    if t.numel() and (t.stride(-1) != 1 or 0 in t.stride()):
        raise UnsupportedInput(
            f"{name} must be contiguous in its last dimension, without zero strides; its strides "
            f"are {t.stride()} (use {name}.contiguous())"
        )


def check_max_seqlen(name: str, value) -> None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0
    ):
        raise UnsupportedInput(
            f"{name} must be a non-negative Python int or None (not a tensor: reading one costs a "
            f"device sync), got {value!r}"
        )


def check_varlen_inputs(q, k, v, ragged: Ragged, causal) -> bool:
    """UnsupportedInput naming what is not supported, for every check but the device; True when
    there is nothing to compute (no sequence, no query row, or no key in any sequence): the caller
    returns O zero and LSE -inf without a launch."""

    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dense(name, t, "attention_varlen")
    if ragged.varlen_k and ragged.paged:
        raise UnsupportedInput(
            "give cu_seqlens_k (packed k and v) or page_table (paged k and v), not both"
        )
    q_rank = 3 if ragged.varlen_q else 4
    kv_rank = 3 if ragged.varlen_k else 4
    q_form = "(total_q, heads, head_dim)" if ragged.varlen_q else "(batch, seqlen, heads, head_dim)"
    kv_form = (
        "(total_k, heads, head_dim)"
        if ragged.varlen_k
        else "(num_pages, page_size, heads, head_dim)"
        if ragged.paged
        else "(batch, seqlen, heads, head_dim)"
    )
    if q.dim() != q_rank:
        raise UnsupportedInput(
            f"q must be {q_form}{' with cu_seqlens_q' if ragged.varlen_q else ''}; it has shape "
            f"{tuple(q.shape)}"
        )
    for name, t in (("k", k), ("v", v)):
        if t.dim() != kv_rank:
            raise UnsupportedInput(f"{name} must be {kv_form}; it has shape {tuple(t.shape)}")
    check_elements(q, k, v)
    if k.shape[:-1] != v.shape[:-1]:
        raise UnsupportedInput(
            f"k and v must agree in all but head_dim; k is {tuple(k.shape)}, v is {tuple(v.shape)}"
        )
    check_heads(q, k)
    if not isinstance(causal, bool):
        raise UnsupportedInput(f"causal must be True or False, got {causal!r}")
    check_max_seqlen("max_seqlen_q", ragged.max_seqlen_q)
    check_max_seqlen("max_seqlen_k", ragged.max_seqlen_k)

    # The batch: cu_seqlens_q's, else q's; every other index tensor and k must agree.
    if ragged.varlen_q:
        check_dense("cu_seqlens_q", ragged.cu_seqlens_q, "attention_varlen")
        if ragged.cu_seqlens_q.dim() != 1 or ragged.cu_seqlens_q.shape[0] < 1:
            raise UnsupportedInput(
                f"cu_seqlens_q must have shape (batch + 1,); it has "
                f"{tuple(ragged.cu_seqlens_q.shape)}"
            )
        batch = ragged.cu_seqlens_q.shape[0] - 1
        _check_index("cu_seqlens_q", ragged.cu_seqlens_q, (batch + 1,))
    else:
        batch = q.shape[0]
    if ragged.varlen_k:
        _check_index("cu_seqlens_k", ragged.cu_seqlens_k, (batch + 1,))
    if ragged.seqused_k is not None:
        _check_index("seqused_k", ragged.seqused_k, (batch,))
    if ragged.paged:
        _check_index("page_table", ragged.page_table, (batch, None))
        page_size = k.shape[1]
        if page_size not in PAGE_SIZES:
            raise UnsupportedInput(
                f"page size {page_size} (k.shape[1]) is not supported: pages of a power of two "
                f"from {PAGE_SIZES[0]} to {PAGE_SIZES[-1]} rows are (the K/V loads are TMA boxes "
                "of whole pages)"
            )
    elif not ragged.varlen_k and k.shape[0] != batch:
        raise UnsupportedInput(
            f"batch-shaped k and v must have one batch per sequence ({batch}); k is "
            f"{tuple(k.shape)}"
        )
    if ragged.varlen_q:
        total_q = q.shape[0]
        empty = batch == 0 or total_q == 0
    else:
        empty = batch == 0 or q.shape[1] == 0
    if ragged.varlen_k:
        empty = empty or k.shape[0] == 0
    elif ragged.paged:
        empty = empty or ragged.page_table.shape[1] == 0 or k.shape[0] == 0
    else:
        empty = empty or k.shape[1] == 0
    if empty:
        return True
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_strides(name, t)
    if ragged.paged or (ragged.seqused_k is not None and not ragged.varlen_k):
        # Pages (batches) are read as packed rows: one must follow the other.
        what = "pages" if ragged.paged else "batches"
        for name, t in (("k", k), ("v", v)):
            if t.shape[0] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
                raise UnsupportedInput(
                    f"the {what} of {name} must be whole rows one after the other "
                    f"({name}.stride(0) == {name}.shape[1] * {name}.stride(1)); its strides are "
                    f"{t.stride()} (use {name}.contiguous())"
                )
    return False


def make_problem(q, k, v, ragged: Ragged, causal) -> Problem:
    """The Problem of a ragged call that check_varlen_inputs passed, not empty (module
    docstring)."""
    if ragged.varlen_q:
        batch, total_q = ragged.cu_seqlens_q.shape[0] - 1, q.shape[0]
        seqlen_q = _longest(ragged.max_seqlen_q, total_q, batch)
    else:
        batch, total_q, seqlen_q = q.shape[0], None, q.shape[1]
    total_k = page_size = None
    if ragged.varlen_k:
        total_k = k.shape[0]
        seqlen_k = _longest(ragged.max_seqlen_k, total_k, batch)
    elif ragged.paged:
        page_size = k.shape[1]
        capacity = ragged.page_table.shape[1] * page_size
        seqlen_k = min(_pow2(ragged.max_seqlen_k or capacity), capacity)
    else:
        seqlen_k = min(_pow2(ragged.max_seqlen_k or k.shape[1]), k.shape[1])
    try:
        return Problem(
            dtype=str(q.dtype),
            head_dim=q.shape[-1],
            head_dim_v=v.shape[-1],
            causal=causal,
            seqlen_q=seqlen_q,
            seqlen_k=max(seqlen_k, 1),
            batch=batch,
            nheads_q=q.shape[-2],
            nheads_kv=k.shape[-2],
            total_q=total_q,
            total_k=total_k,
            page_size=page_size,
            seqused_k=ragged.seqused_k is not None,
        )
    except ProblemError as exc:
        raise UnsupportedInput(str(exc)) from exc


def _longest(given: int | None, total: int, batch: int) -> int:
    """The longest sequence of a packed tensor for the key: the caller's maximum rounded up to a
    power of two, brought into [ceil(total / batch), total] (what `batch` sequences of `total` rows
    allow), else the total."""
    if given is None:
        return total
    return min(max(_pow2(given), -(-total // batch)), total)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def output_shapes(q, v, ragged: Ragged) -> tuple[tuple, tuple]:
    """(out, lse) shapes: like q with head_dim_v, and (nheads_q, total_q) or (batch, nheads_q,
    seqlen_q), as flash-attn-4's varlen call returns them."""
    if ragged.varlen_q:
        return packed_output_shapes(q.shape[0], q.shape[1], v.shape[-1])
    return batch_output_shapes(q, v)


def packed_output_shapes(total_q: int, nheads_q: int, head_dim_v: int) -> tuple[tuple, tuple]:
    """(out, lse) shapes of packed queries: (total_q, nheads_q, head_dim_v), (nheads_q, total_q)."""
    return (total_q, nheads_q, head_dim_v), (nheads_q, total_q)


def check_varlen_device(q, k, v, ragged: Ragged, aligned: bool = True) -> None:
    """Every tensor on q's CUDA device; q, k and v 16-byte aligned (TMA), the index tensors 4-byte
    aligned (not checked with `aligned` False: nothing is read), or UnsupportedInput. What is not
    checked, and cannot be without reading the device: that cu_seqlens are non-decreasing and end
    at the totals, that seqused_k fits its sequence, and that page ids are below num_pages."""
    tensors = [("q", q), ("k", k), ("v", v)] + [
        (name, t)
        for name, t in zip(
            _INDEX_NAMES,
            (ragged.cu_seqlens_q, ragged.cu_seqlens_k, ragged.seqused_k, ragged.page_table),
        )
        if t is not None
    ]
    for name, t in tensors:
        if not t.is_cuda:
            raise UnsupportedInput(f"attention needs CUDA tensors; {name} is on {t.device}")
        if t.device != q.device:
            raise UnsupportedInput(
                f"every tensor must be on q's device; q is on {q.device}, {name} on {t.device}"
            )
        align = 16 if name in ("q", "k", "v") else 4
        if aligned and t.data_ptr() % align:
            raise UnsupportedInput(
                f"{name} must start at a {align}-byte aligned address; pass {name}.clone()"
            )
