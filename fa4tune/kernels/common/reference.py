"""The fp32 reference of the forward pass, in torch: what every kernel is checked against."""

from __future__ import annotations

import math


def attention_reference(q, k, v, causal: bool = False, softmax_scale: float | None = None):
    """O and LSE of softmax(scale·Q Kᵀ [+ bottom-right causal mask]) V, computed in float32.

    q: (batch, seqlen_q, nheads_q, d); k, v: (batch, seqlen_k, nheads_kv, d[_v]); nheads_q a
    multiple of nheads_kv. Returns O as (batch, seqlen_q, nheads_q, d_v) float32 and LSE as (batch,
    nheads_q, seqlen_q) float32 in natural log. A row that sees no key (causal with seqlen_q >
    seqlen_k) has O = 0 and LSE = -inf, as in FlashAttention.
    """
    import torch

    batch, seqlen_q, nheads_q, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    if nheads_q % nheads_kv:
        raise ValueError(f"nheads_q ({nheads_q}) must be a multiple of nheads_kv ({nheads_kv})")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    group = nheads_q // nheads_kv
    qf = q.float().permute(0, 2, 1, 3)  # (b, h, sq, d)
    kf = k.float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    vf = v.float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        cols = torch.arange(seqlen_k, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (seqlen_k - seqlen_q), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # -inf for empty rows
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(torch.float32).min))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.matmul(probs, vf).permute(0, 2, 1, 3).contiguous()
    return out, lse.contiguous()


def attention_grads_reference(q, k, v, dout, causal: bool = False, softmax_scale=None, dlse=None):
    """(dq, dk, dv) in float32 of attention_reference's O (and LSE, given `dlse`) given dout, by the
    formulas (no autograd: it runs inside an op's implementation too). With S = scale Q Kᵀ
    (masked), P = exp(S - LSE): dV = Pᵀ dO, dP = dO Vᵀ, dS = P (dP - rowsum(P dP) + dlse),
    dQ = scale dS K, dK = scale dSᵀ Q; dK and dV summed over the query heads of each K/V head."""
    import torch

    batch, seqlen_q, nheads_q, d = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads_q // nheads_kv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    qf = q.float().permute(0, 2, 1, 3)  # (b, h, sq, d)
    kf = k.float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    vf = v.float().repeat_interleave(group, dim=2).permute(0, 2, 1, 3)
    do = dout.float().permute(0, 2, 1, 3)
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale
    if causal:
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        cols = torch.arange(seqlen_k, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + (seqlen_k - seqlen_q), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.nan_to_num(torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min)))
    dp = torch.matmul(do, vf.transpose(-1, -2))
    ds = probs * (dp - (probs * dp).sum(-1, keepdim=True))
    if dlse is not None:
        ds = ds + probs * dlse.float()[..., None]
    dq = torch.matmul(ds, kf) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qf) * scale
    dv = torch.matmul(probs.transpose(-1, -2), do)

    def per_kv_head(t):  # (b, h, s, d) -> (b, s, h_kv, d), the group summed
        return t.reshape(batch, nheads_kv, group, seqlen_k, -1).sum(2).permute(0, 2, 1, 3)

    return dq.permute(0, 2, 1, 3).contiguous(), per_kv_head(dk), per_kv_head(dv)
