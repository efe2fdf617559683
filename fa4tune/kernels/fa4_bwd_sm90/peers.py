"""What the backward kernel is benchmarked against: flash-attn-4's backward and cuDNN's through
torch SDPA. Each peer's `prepare(problem, q, k, v, dout)` gives a function that runs the peer's
backward once and returns (dq, dk, dv), its forward run before (outside the timing)."""

from __future__ import annotations

from ..fa4_fwd_sm90.peers import CUDNN, FA4  # the same peers' names in both families
from ..family import Peer, PeerUnavailable


def fa4_backward(problem, q, k, v, dout):
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:
        raise PeerUnavailable(f"not installed ({type(exc).__name__}: {exc})"[:120]) from None
    import torch

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    result = flash_attn_func(*leaves, causal=problem.causal)
    out = result[0] if isinstance(result, tuple) else result

    def run():
        return torch.autograd.grad(out, leaves, dout, retain_graph=True)

    return run


def cudnn_backward(problem, q, k, v, dout):
    if problem.causal and problem.seqlen_q != problem.seqlen_k:
        raise PeerUnavailable("n/a (SDPA's causal mask is top-left aligned)")
    import torch
    import torch.nn.functional as F

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    qt, kt, vt = (t.transpose(1, 2) for t in leaves)
    gqa = problem.nheads_q != problem.nheads_kv
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=problem.causal, enable_gqa=gqa)
    grad = dout.transpose(1, 2)

    def run():
        return torch.autograd.grad(out, leaves, grad, retain_graph=True)

    return run


PEERS = (Peer(FA4, fa4_backward), Peer(CUDNN, cudnn_backward))
