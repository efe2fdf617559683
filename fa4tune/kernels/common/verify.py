"""The correctness gate of the attention families: a kernel's output and LSE against the fp32
reference.

The reference of a whole problem does not fit (16k x 16k scores per head, 128k x 128k at long
context), so it is computed on slices: the first and the last batch, the first and the last query
head (so both ends of the GQA groups), and the first and the last block of query rows; and one slice
from the middle of all three (middle batch, middle head, a block of rows from the middle), where a
tile scheduler or an L2 grouping that computes the wrong tile would write finite, wrong values that
the ends never see. For a
bottom-right-aligned causal mask a block of rows is itself a bottom-right-aligned problem once the
keys are cut where its last row stops seeing them, so each slice goes through the same
`attention_reference`. Unwritten outputs are caught over the whole tensors: the outputs are filled
with NaN before the kernel runs."""

from __future__ import annotations

import math

from ..family import Check, Tolerance
from .reference import attention_reference

ROWS_PER_SLICE = 512


# bf16 keeps 8 mantissa bits, fp16 11: O is rounded to them, the LSE is fp32 throughout.
TOLERANCES = {"bf16": Tolerance(out=1e-2, lse=1e-3), "fp16": Tolerance(out=5e-3, lse=1e-3)}


def _keys_seen(end: int, seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    return seqlen_k if not causal else max(0, min(seqlen_k, end + seqlen_k - seqlen_q))


def row_slices(
    seqlen_q: int, seqlen_k: int, causal: bool, rows: int = ROWS_PER_SLICE
) -> list[tuple[int, int, int]]:
    """(first row, end row, keys seen) of the query-row blocks to check. Without a mask every key is
    seen; with the bottom-right causal mask row i sees keys j <= i + seqlen_k - seqlen_q, so a block
    ending at row `end` needs the first `end + seqlen_k - seqlen_q` keys (clamped)."""
    blocks = [(0, min(rows, seqlen_q))]
    if seqlen_q > rows:
        blocks.append((max(rows, seqlen_q - rows), seqlen_q))
    return [(start, end, _keys_seen(end, seqlen_q, seqlen_k, causal)) for start, end in blocks]


def middle_slice(
    batch: int,
    nheads_q: int,
    seqlen_q: int,
    seqlen_k: int,
    causal: bool,
    rows: int = ROWS_PER_SLICE,
) -> tuple[int, int, int, int, int] | None:
    """(batch, head, first row, end row, keys seen) of the slice from the middle, or None when the
    first and last slices already cover every row (no rows between them). Half a block wide, it
    starts off the tile grid (an odd row), so it cuts across tiles of every size."""
    if seqlen_q <= 2 * rows:
        return None
    width = max(1, rows // 2)
    start = (seqlen_q - width) // 2 | 1
    end = start + width
    return batch // 2, nheads_q // 2, start, end, _keys_seen(end, seqlen_q, seqlen_k, causal)


def reference_slices(
    q, k, v, causal: bool, softmax_scale: float | None, rows: int = ROWS_PER_SLICE
):
    """[(index, reference O, reference LSE)] where `index` = (batch, head, row start, row end) picks
    the slice of the kernel's O (b, s, h, d) and LSE (b, h, s) to compare."""
    batch, seqlen_q, nheads_q, _ = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads_q // nheads_kv
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    picked = [
        (b, h, start, end, keys)
        for b in sorted({0, batch - 1})
        for h in sorted({0, nheads_q - 1})
        for start, end, keys in row_slices(seqlen_q, seqlen_k, causal, rows)
    ]
    middle = middle_slice(batch, nheads_q, seqlen_q, seqlen_k, causal, rows)
    if middle is not None:
        picked.append(middle)
    out = []
    for b, h, start, end, keys in picked:
        kv = h // group
        qs = q[b : b + 1, start:end, h : h + 1]
        if keys == 0:  # causal rows before the first key: O = 0 and LSE = -inf by definition
            import torch

            ref_o = torch.zeros(
                (1, end - start, 1, v.shape[3]), dtype=torch.float32, device=q.device
            )
            ref_lse = torch.full((1, 1, end - start), float("-inf"), device=q.device)
        else:
            ref_o, ref_lse = attention_reference(
                qs,
                k[b : b + 1, :keys, kv : kv + 1],
                v[b : b + 1, :keys, kv : kv + 1],
                causal=causal,
                softmax_scale=scale,
            )
        out.append(((b, h, start, end), ref_o, ref_lse))
    return out


def compare(out, lse, references) -> Check:
    """Errors of the kernel's `out` and `lse` against `reference_slices`; NaN anywhere in them (the
    poison they were filled with, or a NaN the kernel made) is a problem by itself. `lse` None: the
    output alone (for implementations that return no LSE)."""
    import torch

    if torch.isnan(out).any().item():
        return Check(
            math.nan, math.nan, "NaN in the output: some elements were never written or are NaN"
        )
    if lse is not None and torch.isnan(lse).any().item():
        return Check(math.nan, math.nan, "NaN in the LSE: some rows were never written or are NaN")
    # O's error per slice, the worst one counting: summed over the slices, the rows that see few
    # keys (large O) would drown the rest (at 16k causal the first rows' blocks hold 99% of the
    # norm, and a slice of long rows 10% off would pass).
    out_error, worst = 0.0, None
    lse_error = 0.0
    for index, ref_o, ref_lse in references:
        b, h, start, end = index
        got_o = out[b : b + 1, start:end, h : h + 1].float()
        error = (got_o - ref_o).norm().item() / max(ref_o.norm().item(), 1e-30)
        if error > out_error or (
            math.isnan(error) and not math.isnan(out_error)
        ):  # a NaN stays worst
            out_error, worst = error, index
        if lse is None:
            continue
        got_lse = lse[b : b + 1, h : h + 1, start:end]
        finite = torch.isfinite(ref_lse)
        if not torch.equal(finite, torch.isfinite(got_lse)):
            return Check(
                math.nan,
                math.nan,
                "LSE is finite where the reference row sees no key, or the reverse",
            )
        if finite.any():
            lse_error = max(lse_error, (got_lse[finite] - ref_lse[finite]).abs().max().item())
    return Check(out_error, lse_error, worst=worst)
