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


@dataclass(frozen=True)
class RaggedCase:
    """The device buffers of one ragged problem (varlen, paged or seqused_k), on the token mix of
    mixes.sequence_lengths: q, k, v in flash-attn-4's varlen layouts, the index tensors (`ragged`)
    and the outputs; with the lengths and where each sequence's rows lie, for the reference. A
    paged cache's pages are shuffled, as a serving engine's are after a while."""

    problem: object
    q: object
    k: object
    v: object
    out: object
    lse: object
    ragged: object  # common.varlen.Ragged, its tensors on the device
    q_lens: list
    k_lens: list
    q_starts: list  # a sequence's first row in packed q (varlen q)
    k_starts: list  # its first row in packed k and v (varlen k)
    pages: list  # paged: each sequence's page ids in order
    # K/V rows no sequence uses (past seqused_k, in unused pages): filled with NaN by randomize, so
    # that a kernel which lets them into O shows.
    unused_k: object = None


def attention_case(problem, device):
    """Uninitialised buffers of the problem's inputs (batch, seqlen, heads, dim) and outputs (O like
    q with head_dim_v, LSE (batch, nheads_q, seqlen_q) float32) on `device`; a RaggedCase for a
    ragged problem."""
    import torch

    if problem.layout.ragged:
        return ragged_case(problem, device)

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


def ragged_case(problem, device, lengths=None) -> RaggedCase:
    """A RaggedCase of the problem's token mix (or of `lengths`, (query lengths, key lengths) that
    the problem's key allows), its inputs uninitialised."""
    import torch

    from ...mixes import sequence_lengths
    from .varlen import Ragged, output_shapes

    dtype = torch.bfloat16 if problem.dtype == "bf16" else torch.float16
    p, layout = problem, problem.layout
    q_lens, k_lens = sequence_lengths(problem) if lengths is None else map(list, lengths)
    batch, d, dv, hq, hk = p.batch, p.head_dim, p.head_dim_v, p.nheads_q, p.nheads_kv

    def starts(lengths):
        out, at = [], 0
        for n in lengths:
            out.append(at)
            at += n
        return out + [at]

    def int32(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    q_starts, k_starts, pages = starts(q_lens), starts(k_lens), []
    cu_q = cu_k = seqused = table = None
    if layout.varlen_q:
        q = torch.empty(p.total_q, hq, d, dtype=dtype, device=device)
        cu_q = int32(q_starts)
    else:
        q = torch.empty(batch, p.seqlen_q, hq, d, dtype=dtype, device=device)
    unused = None
    if layout.varlen_k:
        k = torch.empty(p.total_k, hk, d, dtype=dtype, device=device)
        v = torch.empty(p.total_k, hk, dv, dtype=dtype, device=device)
        cu_k = int32(k_starts)
        if layout.seqused_k:  # use fewer keys than each sequence has: the rest are poisoned
            used = [n - n // 4 for n in k_lens]
            unused = torch.ones(p.total_k, dtype=torch.bool, device=device)
            for start, n in zip(k_starts, used):
                unused[start : start + n] = False
            k_lens = used
    elif layout.paged:
        size = layout.page_size
        width = -(-p.seqlen_k // size)
        needed = [-(-n // size) for n in k_lens]
        spare = max(1, sum(needed) // 8)  # pages nobody uses, among the others
        order = torch.randperm(sum(needed) + spare, generator=torch.Generator().manual_seed(0))
        ids = order.tolist()
        table_rows, at = [], 0
        for n in needed:
            pages.append(ids[at : at + n])
            # Past the used pages the table holds ids of no page: never followed.
            table_rows.append(ids[at : at + n] + [-1] * (width - n))
            at += n
        k = torch.empty(len(ids), size, hk, d, dtype=dtype, device=device)
        v = torch.empty(len(ids), size, hk, dv, dtype=dtype, device=device)
        table = int32(table_rows)
        unused = torch.ones(len(ids) * size, dtype=torch.bool, device=device)
        for seq, n in zip(pages, k_lens):
            for j, page in enumerate(seq):
                rows = min(size, n - j * size)
                unused[page * size : page * size + rows] = False
    else:
        k = torch.empty(batch, p.seqlen_k, hk, d, dtype=dtype, device=device)
        v = torch.empty(batch, p.seqlen_k, hk, dv, dtype=dtype, device=device)
        if layout.seqused_k:
            unused = torch.ones(batch * p.seqlen_k, dtype=torch.bool, device=device)
            for b, n in enumerate(k_lens):
                unused[b * p.seqlen_k : b * p.seqlen_k + n] = False
    if layout.seqused_k:
        seqused = int32(k_lens)
    ragged = Ragged(cu_q, cu_k, seqused, table, p.seqlen_q, p.seqlen_k)
    out_shape, lse_shape = output_shapes(q, v, ragged)
    return RaggedCase(
        problem,
        q,
        k,
        v,
        torch.empty(out_shape, dtype=dtype, device=device),
        torch.empty(lse_shape, dtype=torch.float32, device=device),
        ragged,
        q_lens,
        k_lens,
        q_starts,
        k_starts,
        pages,
        unused,
    )


def randomize(case, seed: int, unused_nan: bool = True) -> None:
    """Fresh normal inputs; the K/V rows of a ragged case that no sequence uses NaN (unless
    `unused_nan` is False: a benchmark's peer may read them, as long as it masks them)."""
    import torch

    generator = torch.Generator(device=case.q.device).manual_seed(seed)
    for tensor in (case.q, case.k, case.v):
        tensor.normal_(generator=generator)
    if isinstance(case, RaggedCase) and case.unused_k is not None and unused_nan:
        # K/V rows that no sequence uses hold NaN: the kernel must never let them into O.
        for tensor in (case.k, case.v):
            rows = tensor.view(-1, *tensor.shape[-2:])
            rows[case.unused_k] = float("nan")


def poison(case) -> None:
    case.out.fill_(float("nan"))
    case.lse.fill_(float("nan"))


def reference(case):
    if isinstance(case, RaggedCase):
        return ragged_reference(case)
    return reference_slices(case.q, case.k, case.v, case.problem.causal, None)


def check(case, references):
    if isinstance(case, RaggedCase):
        return ragged_check(case, references)
    return compare(case.out, case.lse, references)


def checked_sequences(case: RaggedCase) -> list[int]:
    """The sequences checked against the reference: the first, the last, the longest, one without
    queries or keys if any, and one from the middle."""
    batch = len(case.q_lens)
    picked = {0, batch - 1, batch // 2, max(range(batch), key=lambda b: case.q_lens[b])}
    empty = [b for b in range(batch) if case.q_lens[b] == 0 or case.k_lens[b] == 0]
    picked.update(empty[:1])
    return sorted(picked)


def sequence_kv(case: RaggedCase, b: int):
    """Sequence b's keys and values as batch-shaped (1, keys, heads, d) tensors."""
    import torch

    n, layout = case.k_lens[b], case.problem.layout
    if layout.varlen_k:
        start = case.k_starts[b]
        return case.k[start : start + n][None], case.v[start : start + n][None]
    if layout.paged:
        ids = torch.tensor(case.pages[b], dtype=torch.long, device=case.k.device)
        k = case.k[ids].flatten(0, 1)[:n]
        v = case.v[ids].flatten(0, 1)[:n]
        return k[None], v[None]
    return case.k[b : b + 1, :n], case.v[b : b + 1, :n]


def sequence_out(case: RaggedCase, b: int):
    """Sequence b's queries, O and LSE as batch-shaped (1, queries, ...) and (1, heads, queries)."""
    n = case.q_lens[b]
    if case.problem.layout.varlen_q:
        start = case.q_starts[b]
        rows = slice(start, start + n)
        return case.q[rows][None], case.out[rows][None], case.lse[:, rows][None]
    return case.q[b : b + 1, :n], case.out[b : b + 1, :n], case.lse[b : b + 1, :, :n]


def ragged_reference(case: RaggedCase):
    """[(sequence, its reference slices)] for checked_sequences (a sequence without queries has
    none; one without keys is checked against O 0 and LSE -inf)."""
    import torch

    refs = []
    for b in checked_sequences(case):
        q, _, _ = sequence_out(case, b)
        if q.shape[1] == 0:
            continue
        k, v = sequence_kv(case, b)
        if k.shape[1] == 0:
            heads, dv = q.shape[2], case.v.shape[-1]
            zero = torch.zeros((1, q.shape[1], heads, dv), dtype=torch.float32, device=q.device)
            lse = torch.full((1, heads, q.shape[1]), float("-inf"), device=q.device)
            refs.append(
                (
                    b,
                    [
                        ((0, h, 0, q.shape[1]), zero[:, :, h : h + 1], lse[:, h : h + 1])
                        for h in sorted({0, heads - 1})
                    ],
                )
            )
            continue
        refs.append((b, reference_slices(q, k, v, case.problem.causal, None)))
    return refs


def ragged_check(case: RaggedCase, references):
    """The worst of the checked sequences' errors (verify.compare per sequence), after a NaN check
    of the whole outputs: every row of O and LSE belongs to some sequence and must be written."""
    import math

    import torch

    from ..family import Check

    if torch.isnan(case.out).any().item():
        return Check(
            math.nan, math.nan, "NaN in the output: some rows were never written or are NaN"
        )
    if torch.isnan(case.lse).any().item():
        return Check(math.nan, math.nan, "NaN in the LSE: some rows were never written or are NaN")
    out_error = lse_error = 0.0
    worst = None
    for b, slices in references:
        _, out, lse = sequence_out(case, b)
        result = compare(out, lse, slices)
        if result.problem:
            return Check(result.out_error, result.lse_error, f"sequence {b}: {result.problem}")
        if result.out_error >= out_error:
            out_error = result.out_error
            worst = (b,) + tuple(result.worst[1:]) if result.worst else worst
        lse_error = max(lse_error, result.lse_error)
    return Check(out_error, lse_error, worst=worst)


def tolerance(problem):
    return TOLERANCES[problem.dtype]
