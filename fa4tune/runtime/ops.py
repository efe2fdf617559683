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

`fa4tune.attention` (this module's `attention`) runs the eager path directly when nothing traces,
so that eager calls do not pay for torch's op dispatcher, and calls the op while torch.compile or
torch.export traces. The backward family registers its autograd on this op.

A program exported with this op needs the op registered where it is loaded: import
`fa4tune.runtime.ops` (touching `fa4tune.attention` does it too) before `torch.export.load`."""

from __future__ import annotations

import torch

from ..errors import UnsupportedInput
from ..kernels.common.inputs import check_device, check_inputs, check_no_grad, check_scale
from . import dispatch

OP = "fa4tune::attention"

__all__ = ["OP", "attention"]


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None):
    """(out, lse) of softmax(scale · q kᵀ [+ causal mask]) v by the tuned kernel, as flash-attn-4's
    `flash_attn_func`; the arguments and results are described in fa4tune.runtime.dispatch."""
    if _compiling():
        return _traced(q, k, v, causal, softmax_scale)
    return dispatch.attention(q, k, v, causal, softmax_scale)


_compiling = torch.compiler.is_compiling


def _traced(q, k, v, causal, softmax_scale):
    """The op's call as torch.compile or torch.export records it. What the op's schema would refuse
    with torch's own words (a causal that is not a bool, a scale that is not a number) and what
    autograd decides (the op has no backward yet) is checked here, in the traced code; the rest in
    the fake implementation."""
    if not isinstance(causal, bool):
        raise UnsupportedInput(f"causal must be True or False, got {causal!r}")
    check_scale(softmax_scale)
    check_no_grad(q, k, v)
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
    batch, seqlen_q, nheads_q, _ = q.shape
    # As the eager path allocates them: contiguous, on q's device.
    out = q.new_empty((batch, seqlen_q, nheads_q, v.shape[3]))
    lse = q.new_empty((batch, nheads_q, seqlen_q), dtype=torch.float32)
    return out, lse
