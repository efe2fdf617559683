"""Token mixes: the sequence lengths a ragged problem is measured on.

A ragged problem's key holds what a caller knows without reading the device (the longest
sequences, the totals, the batch: fa4tune.problem.Problem), not the lengths themselves. A search
measures each candidate on one mix drawn from that key, the same mix for every candidate and every
run (the generator is seeded by the problem key):

- packed queries (varlen q): lengths log-uniform over [seqlen_q / 32, seqlen_q] (at least 1) --
  prompts spread over orders of magnitude, as in chat and serving traces -- one of them exactly
  seqlen_q, the others scaled so that all sum to total_q (each kept within [0, seqlen_q]);
- packed keys (varlen k): the queries' own lengths when the key says the same totals and longest
  sequence (self-attention over packed sequences, the usual prefill), else drawn as the queries;
- keys of a paged cache or with seqused_k and no total (decode contexts): uniform over
  [seqlen_k / 2, seqlen_k], one of them exactly seqlen_k, and never fewer than the sequence's own
  queries (a prefill chunk sees itself); a paged cache without seqused_k uses every page;
- batch-shaped inputs: every sequence at its full extent.

Plain Python: nothing here imports torch."""

from __future__ import annotations

import hashlib
import math
import random
from functools import lru_cache

# The shortest prompt of a varlen mix, as a fraction of the longest.
SHORTEST_OF_LONGEST = 1 / 32
# Decode contexts: the shortest as a fraction of the longest.
SHORTEST_CONTEXT = 1 / 2


def _generator(problem, salt: str) -> random.Random:
    digest = hashlib.sha256(f"{problem.key()}/{salt}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "little"))


def packed_lengths(rng: random.Random, batch: int, longest: int, total: int) -> list[int]:
    """`batch` lengths in [0, longest] summing to `total`, one of them `longest`, the others
    log-uniform over [longest * SHORTEST_OF_LONGEST, longest] before they are scaled to the
    total."""
    if not 0 < longest <= total <= batch * longest:
        raise ValueError(f"no {batch} lengths of at most {longest} sum to {total}")
    low = max(1.0, longest * SHORTEST_OF_LONGEST)
    drawn = [math.exp(rng.uniform(math.log(low), math.log(longest))) for _ in range(batch)]
    top = rng.randrange(batch)
    rest = total - longest
    others = [i for i in range(batch) if i != top]
    lengths = [0] * batch
    lengths[top] = longest
    # Scale the others to their share, rounding down, keeping each within [0, longest]; the scale
    # is searched because clamping at `longest` moves what the others must make up.
    lo, hi = 0.0, float(rest) / max(sum(drawn[i] for i in others), 1e-9) * 2 + 1
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(min(longest, int(drawn[i] * mid)) for i in others) > rest:
            hi = mid
        else:
            lo = mid
    for i in others:
        lengths[i] = min(longest, int(drawn[i] * lo))
    # What rounding left over: one row at a time to the sequences with room, in a random order.
    left = rest - sum(lengths[i] for i in others)
    order = others[:]
    rng.shuffle(order)
    while left > 0:
        for i in order:
            if left and lengths[i] < longest:
                lengths[i] += 1
                left -= 1
    return lengths


def context_lengths(rng: random.Random, batch: int, longest: int, floor: list[int]) -> list[int]:
    """Decode contexts: uniform over [longest * SHORTEST_CONTEXT, longest], one exactly `longest`,
    each at least its `floor` (its own queries) and at most `longest`."""
    low = max(1, int(longest * SHORTEST_CONTEXT))
    lengths = [rng.randint(low, longest) for _ in range(batch)]
    lengths[rng.randrange(batch)] = longest
    return [min(longest, max(n, f)) for n, f in zip(lengths, floor)]


def sequence_lengths(problem) -> tuple[list[int], list[int]]:
    """(query lengths, key lengths) of each sequence of the problem's mix (module docstring)."""
    q_lens, k_lens = _sequence_lengths(problem)
    return list(q_lens), list(k_lens)


@lru_cache(maxsize=1024)
def _sequence_lengths(problem) -> tuple[tuple[int, ...], tuple[int, ...]]:
    p, layout = problem, problem.layout
    if layout.varlen_q:
        q_lens = packed_lengths(_generator(p, "q"), p.batch, p.seqlen_q, p.total_q)
    else:
        q_lens = [p.seqlen_q] * p.batch
    if layout.varlen_k:
        if p.total_k == p.total_q and p.seqlen_k == p.seqlen_q:
            k_lens = list(q_lens)
        else:
            k_lens = packed_lengths(_generator(p, "k"), p.batch, p.seqlen_k, p.total_k)
    elif layout.seqused_k:
        k_lens = context_lengths(_generator(p, "k"), p.batch, p.seqlen_k, q_lens)
    elif layout.paged:  # every page of the table
        k_lens = [-(-p.seqlen_k // layout.page_size) * layout.page_size] * p.batch
    else:
        k_lens = [p.seqlen_k] * p.batch
    return tuple(q_lens), tuple(k_lens)
