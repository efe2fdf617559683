"""Checks of the torch tensors an attention call takes (q, k, v in the (batch, seqlen, heads,
head_dim) layout, and outputs a caller passes), the Problem they make, and the outputs of a call
with nothing to compute. Shared by the attention families and the dispatcher; every check but the
device runs on CPU and meta tensors too."""

from __future__ import annotations

import math
import numbers

from ...errors import UnsupportedInput
from ...problem import HEAD_DIMS, Problem

__all__ = [
    "UnsupportedInput",
    "batch_output_shapes",
    "check_dense",
    "check_device",
    "check_elements",
    "check_heads",
    "check_inputs",
    "check_no_grad",
    "check_output",
    "check_scale",
    "check_strides",
    "empty_outputs",
    "launch_outputs",
    "make_problem",
    "problem_of",
]


def problem_of(q, k, v, causal) -> Problem:
    """The Problem of three tensors, or UnsupportedInput naming what is not supported (empty inputs
    too: they have no problem to look up or tune). Checks all but the device, so that it runs on CPU
    and meta tensors too."""
    if check_inputs(q, k, v, causal):
        raise UnsupportedInput(
            f"empty inputs (q {tuple(q.shape)}, k {tuple(k.shape)}) have nothing to look up or tune"
        )
    return make_problem(q, k, v, causal)


def make_problem(q, k, v, causal) -> Problem:
    """The Problem of inputs that check_inputs passed, not empty."""
    return Problem(
        dtype=str(q.dtype),
        head_dim=q.shape[3],
        head_dim_v=v.shape[3],
        causal=causal,
        seqlen_q=q.shape[1],
        seqlen_k=k.shape[1],
        batch=q.shape[0],
        nheads_q=q.shape[2],
        nheads_kv=k.shape[2],
    )


def check_inputs(q, k, v, causal) -> bool:
    """UnsupportedInput naming what is not supported, for every check but the device (so that it
    runs on CPU and meta tensors too; fa4tune.attention and attention_forward both validate their
    inputs here). True when there is nothing to compute: no batch, no query rows or no keys. The
    callers then return O zero and LSE -inf, as flash-attn-4 does (and this kernel for rows without
    keys), without a launch."""

    for name, t in (("q", q), ("k", k), ("v", v)):
        check_dense(name, t)
        if t.dim() != 4:
            raise UnsupportedInput(
                f"attention takes 4-D tensors (batch, seqlen, heads, head_dim); "
                f"{name} has shape {tuple(t.shape)}"
            )
    check_elements(q, k, v)
    if k.shape[:3] != v.shape[:3]:
        raise UnsupportedInput(
            f"k and v must agree in batch, seqlen and heads; k is {tuple(k.shape)}, "
            f"v is {tuple(v.shape)}"
        )
    if k.shape[0] != q.shape[0]:
        raise UnsupportedInput(
            f"q and k must have the same batch size; q is {tuple(q.shape)}, k is {tuple(k.shape)}"
        )
    check_heads(q, k)
    if not isinstance(causal, bool):
        raise UnsupportedInput(f"causal must be True or False, got {causal!r}")
    if 0 in (q.shape[0], q.shape[1], k.shape[1]):
        return True  # nothing is read, so neither strides nor alignment matter
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_strides(name, t)
    return False


def check_dense(name: str, t, caller: str = "attention") -> None:
    """UnsupportedInput unless `t` is a dense (strided, not nested) torch tensor; `caller` names the
    function in the message."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise UnsupportedInput(f"{caller} takes torch tensors; {name} is a {type(t).__name__}")
    if t.layout is not torch.strided or t.is_nested:
        raise UnsupportedInput(
            f"{caller} takes dense tensors; {name} is {'nested' if t.is_nested else t.layout}"
        )


def check_elements(q, k, v) -> None:
    """UnsupportedInput unless q, k and v have one dtype the kernels take (bf16 or fp16) and head
    dims they take (the last dimension in every layout), q's and k's the same."""
    import torch

    if q.dtype not in (torch.bfloat16, torch.float16):
        raise UnsupportedInput(
            f"attention takes bfloat16 or float16 tensors; q is {q.dtype} "
            "(convert with q.to(torch.bfloat16))"
        )
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise UnsupportedInput(
                f"q, k and v must have one dtype; q is {q.dtype}, {name} is {t.dtype}"
            )
    for name, dim in (("head_dim of q and k", q.shape[-1]), ("head_dim of v", v.shape[-1])):
        if dim not in HEAD_DIMS:
            raise UnsupportedInput(
                f"{name} is {dim}; the kernel supports head dims {', '.join(map(str, HEAD_DIMS))}"
            )
    if k.shape[-1] != q.shape[-1]:
        raise UnsupportedInput(
            f"q and k must have the same head_dim; q is {tuple(q.shape)}, k is {tuple(k.shape)}"
        )


def check_heads(q, k) -> None:
    """UnsupportedInput unless q and k have heads (the second-last dimension in every layout) and
    q's are a multiple of k's (grouped-query attention)."""
    nheads_q, nheads_kv = q.shape[-2], k.shape[-2]
    if nheads_q == 0 or nheads_kv == 0:
        raise UnsupportedInput(
            f"q, k and v need at least one head; q is {tuple(q.shape)}, k is {tuple(k.shape)}"
        )
    if nheads_q % nheads_kv:
        raise UnsupportedInput(
            f"the heads of q ({nheads_q}) must be a multiple of the heads of k and v "
            f"({nheads_kv}) (grouped-query attention)"
        )


def check_strides(name: str, t) -> None:
    """UnsupportedInput unless the TMA can read `t` as it is: no zero stride, the last dimension
    contiguous, the other strides multiples of 8 elements (16 bytes)."""
    if 0 in t.stride():
        # An expanded view (k[:, :, :1].expand(...), say), or a size-1 dim given stride 0 (which
        # torch calls contiguous): the DSL's DLPack import takes a zero stride for a constant
        # and misreads the descriptor. (GQA needs no expansion: pass k and v with their own
        # heads.)
        raise UnsupportedInput(
            f"{name} has a zero stride {t.stride()} (an expanded view?); pass "
            f"{name}.clone(memory_format=torch.contiguous_format), or k and v with fewer "
            "heads than q (GQA)"
        )
    if t.stride(-1) != 1:
        raise UnsupportedInput(
            f"{name} must be contiguous in its last dimension (head_dim); its strides are "
            f"{t.stride()} (use {name}.contiguous())"
        )
    if any(s % 8 for s in t.stride()[:-1]):
        # .contiguous() returns a tensor whose only odd strides are of size-1 dims unchanged.
        raise UnsupportedInput(
            f"{name}'s strides {t.stride()} must be multiples of 8 elements (16 bytes, "
            f"for the TMA), those of size-1 dims too; use "
            f"{name}.clone(memory_format=torch.contiguous_format)"
        )


def empty_outputs(q, v, out=None, lse=None, shapes=None):
    """(out, lse) of attention with nothing to compute (check_inputs or check_varlen_inputs said
    so): O zero (a row without keys sums nothing) and LSE -inf (log of that empty sum;
    flash-attn-4's convention, where FA2/FA3 write +inf), into `out` and `lse` when given.
    `shapes`: (out's, lse's), by default those of batch-shaped q and v."""
    import torch

    out_shape, lse_shape = shapes or batch_output_shapes(q, v)
    if out is None:
        out = torch.zeros(out_shape, dtype=q.dtype, device=q.device)
    else:
        check_output("out", out, out_shape, q.dtype, q.device)
        out.zero_()
    if lse is None:
        lse = torch.full(lse_shape, -math.inf, dtype=torch.float32, device=q.device)
    else:
        check_output("lse", lse, lse_shape, torch.float32, q.device, align=4)
        lse.fill_(-math.inf)
    return out, lse


def check_scale(softmax_scale) -> None:
    """UnsupportedInput unless softmax_scale is None or a positive finite real number (a numpy
    float too); not a bool, and not a tensor, which would cost a device sync per call."""
    if softmax_scale is not None and not (
        isinstance(softmax_scale, numbers.Real)
        and not isinstance(softmax_scale, bool)
        and math.isfinite(softmax_scale)
        and softmax_scale > 0
    ):
        raise UnsupportedInput(
            f"softmax_scale must be a positive finite number or None (a Python or numpy "
            f"number, not a tensor or bool), got {softmax_scale!r}"
        )


def check_no_grad(q, k, v, caller: str, instead: str | None = None) -> None:
    """UnsupportedInput when autograd would record this call of `caller`, which has no backward
    (`instead`: the entry point that has one): outputs without a grad_fn would leave q, k and v
    without gradients, silently."""
    import torch

    if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
        way = (
            "or pass detached tensors"
            if instead is None
            else f"pass detached tensors, or call {instead}"
        )
        raise UnsupportedInput(
            f"{caller} has no backward, and q, k or v requires grad: call it under "
            f"torch.no_grad() or torch.inference_mode(), {way}"
        )


def check_device(q, k, v, aligned: bool = True) -> None:
    """CUDA tensors on one device, each starting 16-byte aligned (TMA; not checked with `aligned`
    False: inputs with nothing to compute are not read), or UnsupportedInput."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_cuda:
            raise UnsupportedInput(f"attention needs CUDA tensors; {name} is on {t.device}")
        if t.device != q.device:
            raise UnsupportedInput(
                f"q, k and v must be on one device; q is on {q.device}, {name} on {t.device}"
            )
        if aligned and t.data_ptr() % 16:
            raise UnsupportedInput(
                f"{name} must start at a 16-byte aligned address (for the TMA); pass {name}.clone()"
            )


def batch_output_shapes(q, v) -> tuple[tuple, tuple]:
    """(out, lse) shapes of batch-shaped q and v: (batch, seqlen_q, nheads_q, head_dim_v) and
    (batch, nheads_q, seqlen_q)."""
    batch, seqlen_q, nheads_q = q.shape[:3]
    return (batch, seqlen_q, nheads_q, v.shape[-1]), (batch, nheads_q, seqlen_q)


def launch_outputs(q, out, lse, shapes):
    """(out, lse) for a launch: those the caller passed, checked against `shapes` (out's, lse's:
    check_output's checks, and out's strides multiples of 8 elements for its TMA store), and new
    ones (uninitialised, the kernel writes them whole) for those not passed."""
    import torch

    out_shape, lse_shape = shapes
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    else:
        check_output("out", out, out_shape, q.dtype, q.device)
        if any(s % 8 for s in out.stride()[:-1]):
            raise UnsupportedInput(
                f"out's strides {out.stride()} must be multiples of 8 elements (TMA store)"
            )
    if lse is None:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    else:
        check_output("lse", lse, lse_shape, torch.float32, q.device, align=4)
    return out, lse


def check_output(name: str, t, shape: tuple, dtype, device, align: int = 16) -> None:
    """An output tensor the caller passed (attention_forward's out or lse): the kernel writes it
    with its own strides, so anything but this shape, dtype and device, a unit last stride and an
    `align`-byte aligned start (16 for the TMA store of out), or UnsupportedInput."""
    import torch

    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided or t.is_nested:
        raise UnsupportedInput(f"{name} must be a dense torch tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise UnsupportedInput(
            f"{name} must be {tuple(shape)} {dtype} on {device}; it is {tuple(t.shape)} "
            f"{t.dtype} on {t.device}"
        )
    if t.stride(-1) != 1 or 0 in t.stride() or t.data_ptr() % align or _overlapping(t):
        raise UnsupportedInput(
            f"{name} must be contiguous in its last dimension, without zero strides or "
            f"elements that share memory, and start {align}-byte aligned; its strides are "
            f"{t.stride()}"
        )


def _overlapping(t) -> bool:
    """Whether two elements of t share memory (the kernel's writes to them would race): each dim's
    stride, in increasing order, must step over everything the smaller ones span."""
    span = 1
    for stride, size in sorted(
        (stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1
    ):
        if stride < span:
            return True
        span = stride * size
    return False
