"""What the forward kernel is benchmarked against: flash-attn-4 (with its LSE, as fa4tune always
writes it, and as it runs by default, O alone) and cuDNN through torch SDPA. Each peer's `prepare`
takes the problem and q, k, v in fa4tune's (batch, seqlen, heads, dim) layout and gives a function
that runs the peer once and returns (O in that layout, LSE or None). Ragged problems (varlen, paged)
have their own peers, RAGGED_PEERS, which take the measurement case instead."""

from __future__ import annotations

from ..family import Peer, PeerUnavailable

FA4, FA4_O, CUDNN = "flash-attn-4", "flash-attn-4, O only", "cuDNN"


def _flash_attn_4():
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # not installed, or it does not import here
        raise PeerUnavailable(f"not installed ({type(exc).__name__}: {exc})"[:120]) from None
    return flash_attn_func


def fa4_with_lse(problem, q, k, v):
    fa4 = _flash_attn_4()

    def run():
        result = fa4(q, k, v, causal=problem.causal, return_lse=True)
        if not (isinstance(result, tuple) and len(result) >= 2 and result[1] is not None):
            raise RuntimeError(
                "flash-attn-4 returned no LSE for return_lse=True"
            )  # it would go unchecked
        return result[0], result[1]

    return run


def fa4_o_only(problem, q, k, v):
    fa4 = _flash_attn_4()

    def run():
        result = fa4(q, k, v, causal=problem.causal)
        return (result[0] if isinstance(result, tuple) else result), None

    return run


def cudnn_sdpa(problem, q, k, v):
    """torch SDPA's cuDNN backend, no gradient. Where that path has no GQA, K/V heads are repeated
    once (outside the timed runs after the first; `run.gqa["native"]` then says False)."""
    if problem.causal and problem.seqlen_q != problem.seqlen_k:
        raise PeerUnavailable("n/a (SDPA's causal mask is top-left aligned)")
    import torch
    import torch.nn.functional as F

    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    gqa = {"native": problem.nheads_q != problem.nheads_kv, "kv": (kt, vt)}

    def run():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            try:
                o = F.scaled_dot_product_attention(
                    qt, *gqa["kv"], is_causal=problem.causal, enable_gqa=gqa["native"]
                )
            except RuntimeError:
                if not gqa["native"]:
                    raise
                group = problem.nheads_q // problem.nheads_kv
                gqa["native"], gqa["kv"] = (
                    False,
                    tuple(t.repeat_interleave(group, dim=1) for t in (kt, vt)),
                )
                o = F.scaled_dot_product_attention(qt, *gqa["kv"], is_causal=problem.causal)
        return o.transpose(1, 2), None

    run.gqa = gqa
    return run


PEERS = (Peer(FA4, fa4_with_lse), Peer(FA4_O, fa4_o_only), Peer(CUDNN, cudnn_sdpa))


def _flash_attn_4_varlen():
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:
        raise PeerUnavailable(f"not installed ({type(exc).__name__}: {exc})"[:120]) from None
    return flash_attn_varlen_func


def fa4_varlen(problem, case):
    """flash-attn-4's `flash_attn_varlen_func` on a ragged case (common/measure.RaggedCase): the
    same tensors, cu_seqlens, seqused_k and page table, the LSE returned (as fa4tune writes it)."""
    fa4 = _flash_attn_4_varlen()
    r = case.ragged

    def run():
        result = fa4(
            case.q,
            case.k,
            case.v,
            cu_seqlens_q=r.cu_seqlens_q,
            cu_seqlens_k=r.cu_seqlens_k,
            max_seqlen_q=problem.seqlen_q,
            max_seqlen_k=problem.seqlen_k,
            seqused_k=r.seqused_k,
            page_table=r.page_table,
            causal=problem.causal,
            return_lse=True,
        )
        if not (isinstance(result, tuple) and len(result) >= 2 and result[1] is not None):
            raise RuntimeError("flash-attn-4 returned no LSE for return_lse=True")
        return result[0], result[1]

    return run


# Peers of ragged problems: `prepare(problem, case)` takes the measurement case (RaggedCase).
RAGGED_PEERS = (Peer(FA4, fa4_varlen),)
