"""fa4tune's attention as a torch.library custom op, and `fa4tune.attention`, the function that
reaches it.

`torch.ops.fa4tune.attention(q, k, v, causal=False, softmax_scale=None) -> (out, lse)` is the op:
its implementation is the dispatcher's eager path (`fa4tune.runtime.dispatch.attention`, which
looks the config up and keeps a prepared launch per call signature), and its fake implementation
gives the outputs' shapes, dtypes and strides without running anything, so that
`torch.compile(fullgraph=True)` and `torch.export` capture a call as one node with its shapes
propagated (symbolic ones too). The fake implementation checks what the eager path checks but for
what only real tensors have (data pointers, the GPU's model), so bad input fails while tracing,
with the same `UnsupportedInput`.

`fa4tune.attention` (this module's `attention`) runs the eager path directly when nothing traces
and nothing records gradients, so that inference calls do not pay for torch's op dispatcher, and
calls the op while torch.compile or torch.export traces or autograd records.

The op's backward is `torch.ops.fa4tune.attention_backward(dout, q, k, v, out, lse, dlse, causal,
softmax_scale) -> (dq, dk, dv)`, itself an op with a fake implementation (so that
torch.compile(fullgraph=True) traces forward and backward), whose eager path runs the backward
kernel family (fa4_bwd_sm90) with its tuned config (dispatch.attention_backward). The forward
saves q, k, v, O and LSE for it; a gradient of the returned LSE is honoured.

`torch.ops.fa4tune.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
max_seqlen_k, seqused_k, page_table, causal, softmax_scale) -> (out, lse)` is the ragged call
(flash-attn-4's varlen and paged layouts) as an op, forward only: its eager path is
`fa4tune.runtime.dispatch.attention_varlen`, its fake implementation checks what the eager path
checks without reading a tensor and gives the outputs' shapes. `fa4tune.attention_varlen` (this
module's) calls it while torch.compile or torch.export traces, and the eager path directly
otherwise. The maximums may be symbolic while tracing: they only key the lookup, which runs on
the concrete values when the compiled program calls the op.

A program exported with these ops needs the op registered where it is loaded: import
`fa4tune.runtime.ops` (touching `fa4tune.attention` does it too) before `torch.export.load`."""

from __future__ import annotations

import torch

from ..errors import UnsupportedInput
from ..kernels.common.inputs import (
    batch_output_shapes,
    check_device,
    check_inputs,
    check_no_grad,
    check_scale,
)
from ..kernels.common.varlen import (
    Ragged,
    check_max_seqlen,
    check_varlen_device,
    check_varlen_inputs,
    output_shapes,
)
from . import dispatch

OP = "fa4tune::attention"
BACKWARD_OP = "fa4tune::attention_backward"
VARLEN_OP = "fa4tune::attention_varlen"

__all__ = ["BACKWARD_OP", "OP", "VARLEN_OP", "attention", "attention_varlen"]


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None):
    """(out, lse) of softmax(scale · q kᵀ [+ causal mask]) v by the tuned kernel, as flash-attn-4's
    `flash_attn_func`; the arguments and results are described in fa4tune.runtime.dispatch."""
    if _compiling():
        return _traced(q, k, v, causal, softmax_scale)
    try:
        records = (q.requires_grad or k.requires_grad or v.requires_grad) and _grad_enabled()
    except AttributeError:  # not tensors: the dispatcher says what they are
        records = False
    if records:  # through the op, whose autograd saves what the backward needs
        _check_call(causal, softmax_scale)
        return torch.ops.fa4tune.attention.default(
            q, k, v, causal, None if softmax_scale is None else float(softmax_scale)
        )
    return dispatch.attention(q, k, v, causal, softmax_scale)


_compiling = torch.compiler.is_compiling
_grad_enabled = torch.is_grad_enabled


def _check_call(causal, softmax_scale) -> None:
    """What the op's schema would refuse in torch's own words (a causal that is not a bool, a scale
    that is not a number), refused in fa4tune's."""
    if not isinstance(causal, bool):
        raise UnsupportedInput(f"causal must be True or False, got {causal!r}")
    check_scale(softmax_scale)


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    seqused_k=None,
    page_table=None,
    causal: bool = False,
    softmax_scale: float | None = None,
):
    """(out, lse) of attention over ragged inputs, as flash-attn-4's `flash_attn_varlen_func`;
    the arguments and results are described in fa4tune.runtime.dispatch.attention_varlen and
    docs/serving.md. Forward only."""
    if not _compiling():
        return dispatch.attention_varlen(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            seqused_k=seqused_k,
            page_table=page_table,
            causal=causal,
            softmax_scale=softmax_scale,
        )
    _check_call(causal, softmax_scale)
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        _check_max_traced(name, value)
    # The op has no autograd: refused here, in the traced code, as the eager path refuses it.
    check_no_grad(q, k, v, "fa4tune.attention_varlen")
    return torch.ops.fa4tune.attention_varlen.default(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        seqused_k,
        page_table,
        causal,
        None if softmax_scale is None else float(softmax_scale),
    )


def _check_max_traced(name: str, value) -> None:
    """A maximum the op's schema takes: None, a Python int, or a symbolic one (torch.compile makes
    an int that changes between calls symbolic); the eager path checks the concrete value."""
    if value is None or isinstance(value, torch.SymInt):
        return
    check_max_seqlen(name, value)  # the eager path's words for a tensor, a bool, a negative int


def _traced(q, k, v, causal, softmax_scale):
    """The op's call as torch.compile or torch.export records it: the arguments checked here, in
    the traced code; the tensors in the fake implementation."""
    _check_call(causal, softmax_scale)
    return torch.ops.fa4tune.attention.default(
        q, k, v, causal, None if softmax_scale is None else float(softmax_scale)
    )


@torch.library.custom_op(OP, mutates_args=())
def _attention_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    # For every device: CPU tensors get the dispatcher's UnsupportedInput, not a missing kernel.
    return dispatch.attention(q, k, v, causal, softmax_scale)


@_attention_op.register_fake
def _attention_fake(q, k, v, causal=False, softmax_scale=None):
    check_inputs(q, k, v, causal)
    check_scale(softmax_scale)
    check_device(q, k, v, aligned=False)  # fake tensors have no data to align
    # As the eager path allocates them: contiguous, on q's device.
    out_shape, lse_shape = batch_output_shapes(q, v)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


@torch.library.custom_op(BACKWARD_OP, mutates_args=())
def _attention_backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool = False,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return dispatch.attention_backward(dout, q, k, v, out, lse, dlse, causal, softmax_scale)


@_attention_backward_op.register_fake
def _attention_backward_fake(dout, q, k, v, out, lse, dlse=None, causal=False, softmax_scale=None):
    check_inputs(q, k, v, causal)
    check_device(q, k, v, aligned=False)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


@torch.library.custom_op(VARLEN_OP, mutates_args=())
def _attention_varlen_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    seqused_k: torch.Tensor | None,
    page_table: torch.Tensor | None,
    causal: bool = False,
    softmax_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return dispatch.attention_varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        seqused_k=seqused_k,
        page_table=page_table,
        causal=causal,
        softmax_scale=softmax_scale,
    )


@_attention_varlen_op.register_fake
def _attention_varlen_fake(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_k,
    page_table,
    causal=False,
    softmax_scale=None,
):
    # The maximums may be symbolic here; they key the lookup only, and are checked by the eager
    # path on their concrete values.
    ragged = Ragged(cu_seqlens_q, cu_seqlens_k, seqused_k, page_table)
    check_scale(softmax_scale)
    # An empty call (check_varlen_inputs True) returns zeros and -inf of the same shapes.
    check_varlen_inputs(q, k, v, ragged, causal)
    check_varlen_device(q, k, v, ragged, aligned=False)  # fake tensors have no data to align
    out_shape, lse_shape = output_shapes(q, v, ragged)
    return q.new_empty(out_shape), q.new_empty(lse_shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, causal, softmax_scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.softmax_scale = causal, softmax_scale
    ctx.set_materialize_grads(False)  # an unused LSE needs no zeros


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:  # only the LSE was used
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.fa4tune.attention_backward.default(
        dout, q, k, v, out, lse, dlse, ctx.causal, ctx.softmax_scale
    )
    return dq, dk, dv, None, None


torch.library.register_autograd(OP, _backward, setup_context=_setup_context)
