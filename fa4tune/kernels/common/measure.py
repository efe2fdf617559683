"""What the measuring worker does with a dense attention problem: its q, k, v, out and LSE on the
device (kept from one candidate to the next), fresh random inputs per candidate, outputs poisoned
with NaN before each checked run, and the check against the fp32 reference on slices (verify.py)."""

from __future__ import annotations

from dataclasses import dataclass

from .verify import TOLERANCES, compare, reference_slices


@dataclass(frozen=True)
class AttentionCase:
    """The device buffers of one dense attention problem."""

    problem: object  # fa4tune.problem.Problem
    q: object
    k: object
    v: object
    out: object
    lse: object


def attention_case(problem, device) -> AttentionCase:
    """Uninitialised buffers of the problem's inputs (batch, seqlen, heads, dim) and outputs (O like
    q with head_dim_v, LSE (batch, nheads_q, seqlen_q) float32) on `device`."""
    import torch

    dtype = torch.bfloat16 if problem.dtype == "bf16" else torch.float16
    p = problem
    return AttentionCase(
        problem,
        torch.empty(p.batch, p.seqlen_q, p.nheads_q, p.head_dim, dtype=dtype, device=device),
        torch.empty(p.batch, p.seqlen_k, p.nheads_kv, p.head_dim, dtype=dtype, device=device),
        torch.empty(p.batch, p.seqlen_k, p.nheads_kv, p.head_dim_v, dtype=dtype, device=device),
        torch.empty(p.batch, p.seqlen_q, p.nheads_q, p.head_dim_v, dtype=dtype, device=device),
        torch.empty(p.batch, p.nheads_q, p.seqlen_q, dtype=torch.float32, device=device),
    )


def randomize(case: AttentionCase, seed: int) -> None:
    import torch

    generator = torch.Generator(device=case.q.device).manual_seed(seed)
    for tensor in (case.q, case.k, case.v):
        tensor.normal_(generator=generator)


def poison(case: AttentionCase) -> None:
    case.out.fill_(float("nan"))
    case.lse.fill_(float("nan"))


def reference(case: AttentionCase):
    return reference_slices(case.q, case.k, case.v, case.problem.causal, None)


def check(case: AttentionCase, references):
    return compare(case.out, case.lse, references)


def tolerance(problem):
    return TOLERANCES[problem.dtype]
