"""What the measuring worker does with a backward problem: q, k, v, dO and the forward's O and LSE
on the device (kept from one candidate to the next), fresh random inputs per candidate (O and LSE
from fa4tune's forward kernel), the gradients poisoned with NaN before each checked run, and the
check against the fp32 gradient reference on slices: the first and the last batch, the first and
the last K/V head with every query head of its group (all queries and keys: a K/V head's dK and dV
sum over all of them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..common.reference import attention_grads_reference
from ..family import Check, Tolerance

# bf16 gradients carry bf16 rounding of dS and P in their GEMMs: a few 1e-3 relative against fp32.
TOLERANCES = {"bf16": Tolerance(out=2e-2, lse=math.inf), "fp16": Tolerance(out=1e-2, lse=math.inf)}


@dataclass(frozen=True)
class BackwardCase:
    problem: object
    q: object
    k: object
    v: object
    dout: object
    out: object
    lse: object
    dq: object
    dk: object
    dv: object


def backward_case(problem, device) -> BackwardCase:
    import torch

    dtype = torch.bfloat16 if problem.dtype == "bf16" else torch.float16
    p = problem

    def empty(seqlen, heads, dim, dt=dtype):
        return torch.empty(p.batch, seqlen, heads, dim, dtype=dt, device=device)

    return BackwardCase(
        problem,
        empty(p.seqlen_q, p.nheads_q, p.head_dim),
        empty(p.seqlen_k, p.nheads_kv, p.head_dim),
        empty(p.seqlen_k, p.nheads_kv, p.head_dim_v),
        empty(p.seqlen_q, p.nheads_q, p.head_dim_v),
        empty(p.seqlen_q, p.nheads_q, p.head_dim_v),
        torch.empty(p.batch, p.nheads_q, p.seqlen_q, dtype=torch.float32, device=device),
        empty(p.seqlen_q, p.nheads_q, p.head_dim),
        empty(p.seqlen_k, p.nheads_kv, p.head_dim),
        empty(p.seqlen_k, p.nheads_kv, p.head_dim_v),
    )


def randomize(case: BackwardCase, seed: int) -> None:
    """Fresh q, k, v and dO, and the forward's O and LSE for them (fa4tune's forward kernel with
    its default config)."""
    import torch

    from ...kernels import get_kernel
    from ..fa4_fwd_sm90.launch import attention_forward

    generator = torch.Generator(device=case.q.device).manual_seed(seed)
    for tensor in (case.q, case.k, case.v, case.dout):
        tensor.normal_(generator=generator)
    forward = get_kernel("fa4_fwd_sm90")
    config = forward.default_config(case.problem)
    attention_forward(
        case.q, case.k, case.v, config, causal=case.problem.causal, out=case.out, lse=case.lse
    )


def poison(case: BackwardCase) -> None:
    for tensor in (case.dq, case.dk, case.dv):
        tensor.fill_(float("nan"))


def picked(case: BackwardCase) -> list[tuple[int, int]]:
    """(batch, K/V head) of the slices checked."""
    p = case.problem
    return [(b, h) for b in sorted({0, p.batch - 1}) for h in sorted({0, p.nheads_kv - 1})]


def reference(case: BackwardCase):
    """[((batch, K/V head), reference dq of its query heads, dk, dv)] in fp32."""
    group = case.problem.qheads_per_kvhead
    refs = []
    for b, h in picked(case):
        heads = slice(h * group, (h + 1) * group)
        dq, dk, dv = attention_grads_reference(
            case.q[b : b + 1, :, heads],
            case.k[b : b + 1, :, h : h + 1],
            case.v[b : b + 1, :, h : h + 1],
            case.dout[b : b + 1, :, heads],
            case.problem.causal,
        )
        refs.append(((b, h), dq, dk, dv))
    return refs


def check(case: BackwardCase, references) -> Check:
    """The worst relative error of dq, dk and dv over the picked slices (as the Check's O error),
    after a NaN check of all three: every element of the gradients must be written."""
    import torch

    for name, t in (("dq", case.dq), ("dk", case.dk), ("dv", case.dv)):
        if torch.isnan(t).any().item():
            return Check(math.nan, math.nan, f"NaN in {name}: some elements were never written")
    group = case.problem.qheads_per_kvhead
    worst, where = 0.0, None
    for (b, h), dq, dk, dv in references:
        got = (
            case.dq[b : b + 1, :, h * group : (h + 1) * group],
            case.dk[b : b + 1, :, h : h + 1],
            case.dv[b : b + 1, :, h : h + 1],
        )
        for g, want in zip(got, (dq, dk, dv)):
            error = (g.float() - want).norm().item() / max(want.norm().item(), 1e-30)
            if error > worst or math.isnan(error):
                worst, where = error, (b, h * group, 0, case.problem.seqlen_q)
    return Check(worst, 0.0, worst=where)


def tolerance(problem) -> Tolerance:
    return TOLERANCES[problem.dtype]
