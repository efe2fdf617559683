"""Which config wins: the one home of fa4tune's selection rules, which the results DB, the search
and the runtime lookup all follow.

- `better`: of two best-config entries for one problem, a measurement beats an estimate; of two
  measurements under different L2 flushes (times that do not compare), the one under the flush
  measured with now wins; otherwise the faster one.
- `stores_best`: whether an offered entry replaces the stored best (never a config that was ever
  wrong for the problem; a stored best re-timed in the same rounds is judged by those rounds).
- `beats_default` and `confirmation_order`: after the re-timing of a problem's best few beside its
  default, which one becomes best (a config replaces the default only when it is measurably faster,
  in every round).
- `lenders` with `for_lookup` and `for_warm_start`: which tuned problems lend their config to
  another problem, nearest first, as the runtime lookup climbs its ladder and as a search warms up.

Plain data only: nothing here reads a database or a file."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum


# ---- best configs -------------------------------------------------------------------------------
def flush_of(entry) -> str:
    """The L2 flush a measured entry's time was taken under: its provenance's `l2_flush`, else
    timing.UNRECORDED_FLUSH."""
    from .measure.timing import UNRECORDED_FLUSH  # here: not on `import fa4tune`'s path

    return (entry.provenance or {}).get("l2_flush") or UNRECORDED_FLUSH


def flushes_differ(candidate, incumbent) -> bool:
    """Whether two entries are measurements whose times were taken under different L2 flushes."""
    return (
        not candidate.is_estimate
        and not incumbent.is_estimate
        and flush_of(candidate) != flush_of(incumbent)
    )


def better(candidate, incumbent, flush: str | None = None) -> bool:
    """Whether `candidate` (a BestEntry) beats `incumbent` for the same problem: a measurement beats
    an estimate. Two measurements under different L2 flushes are not compared by time: the one
    under `flush` (the flush measured with now) wins, the candidate where `flush` is None (a search
    offers what it measured itself), else the incumbent stays. Otherwise the faster one wins (a tie
    keeps the incumbent)."""
    if candidate.is_estimate != incumbent.is_estimate:
        return not candidate.is_estimate
    if flushes_differ(candidate, incumbent):
        return flush_of(candidate) == (flush or flush_of(candidate))
    return candidate.time_ms < incumbent.time_ms


def stores_best(
    candidate, stored, *, ever_wrong: bool, stored_retimed: bool = False, flush: str | None = None
) -> bool:
    """Whether `candidate` becomes the problem's best config over `stored` (None: nothing stored
    yet). A config that ever gave a wrong result for the problem with this kernel code never does. A
    stored best that was timed again in the same rounds as the candidate (`stored_retimed`), which
    the caller offers as their winner, is replaced whatever its time from another session.
    Otherwise `better` decides (`flush`: which L2 flush wins over another)."""
    if ever_wrong:
        return False
    return stored is None or stored_retimed or better(candidate, stored, flush)


# ---- confirmation: the default against the fastest -----------------------------------------------
def _rounds(measurement) -> list:
    return (measurement.details or {}).get("rounds_ms") or []


def rounds_won(candidate, default) -> list[int] | None:
    """[rounds where the candidate was faster than the default, rounds compared], or None when the
    two measurements do not carry paired rounds (none, or different numbers of them)."""
    mine, theirs = _rounds(candidate), _rounds(default)
    if not mine or len(mine) != len(theirs):
        return None
    return [sum(a < b for a, b in zip(mine, theirs)), len(mine)]


def beats_default(candidate, default, min_gain: float) -> bool:
    """Whether a confirmed candidate is measurably faster than the default timed beside it: by more
    than `min_gain` (median over the rounds) and in every round where both were timed (the rounds
    are paired: one round times all of them back to back). With 5 rounds, two configs of equal speed
    pass the second test one time in 32; measurements without rounds are judged by the first
    alone."""
    if not 1.0 - candidate.time_ms / default.time_ms > min_gain:
        return False
    if not _rounds(candidate) and not _rounds(default):
        return True
    won = rounds_won(candidate, default)
    return won is not None and won[0] == won[1]  # rounds that do not pair up show nothing


def confirmation_order(
    measured: list, default_index: int | None, min_gain: float
) -> tuple[list, dict | None]:
    """The order in which re-timed configs are offered as best: `measured` holds (measurement, item)
    pairs, ok and never wrong, fastest first; `default_index` says which is the default's. The
    default goes first unless one of those faster than it beats it (`beats_default`); then the
    fastest that does goes first. Returns (the pairs in order, a note when the default was kept over
    a faster config: that one's gain, `min_gain` and the rounds it won; else None)."""
    ordered = list(measured)
    if not ordered or default_index is None or default_index == 0:
        return ordered, None
    default = ordered[default_index]
    faster = ordered[:default_index]
    winner = next((pair for pair in faster if beats_default(pair[0], default[0], min_gain)), None)
    kept = None
    if winner is None:  # none measurably faster: keep the default (one kernel fewer to build)
        fastest = ordered[0][0]
        kept = {
            "fastest_gain": round(1.0 - fastest.time_ms / default[0].time_ms, 5),
            "min_gain": min_gain,
            "rounds_won": rounds_won(fastest, default[0]),
        }
        winner = default
    ordered.remove(winner)
    ordered.insert(0, winner)
    return ordered, kept


# ---- lending configs to other problems -----------------------------------------------------------
class Rung(IntEnum):
    """How close a lender is to the problem (the lookup's ladder, before the default)."""

    EXACT = 0  # the problem itself
    BUCKET = 1  # a problem of its bucket
    NEAREST = 2  # the nearest problem beyond the bucket


@dataclass(frozen=True)
class Lender:
    """A tuned problem's best config as a candidate for another problem."""

    entry: object  # the BestEntry
    problem: object  # the entry's problem, in the borrowing problem's dtype
    sibling: bool  # tuned for the sibling dtype (fp16 for bf16 and back)
    rung: Rung
    closeness: float  # distance of the exact sizes (within a bucket family)
    bucket_distance: float  # distance of the buckets
    current: bool  # tuned for the installed kernel code

    @property
    def source(self) -> str:
        """The lookup's name for where the config came from."""
        return "other-dtype" if self.sibling else self.rung.name.lower()


def lenders(problem, entries, installed_hash: str) -> list[Lender]:
    """The entries (with their problems: (entry, problem) pairs) that may lend their config to
    `problem`: of its dtype or its sibling's, and of its bucket family (head dims, causality)."""
    key, bucket = problem.key(), problem.bucket()
    found = []
    for entry, other in entries:
        lent = other.lent_to(problem)
        if lent is None:
            continue
        other, sibling = lent
        closeness = problem.distance(other)
        if closeness == math.inf:
            continue
        other_bucket = other.bucket()
        rung = (
            Rung.EXACT
            if other.key() == key
            else Rung.BUCKET
            if other_bucket == bucket
            else Rung.NEAREST
        )
        found.append(
            Lender(
                entry,
                other,
                sibling,
                rung,
                closeness,
                bucket.distance(other_bucket),
                entry.kernel_hash == installed_hash,
            )
        )
    return found


def for_lookup(found: list[Lender]) -> list[Lender]:
    """The order the runtime lookup tries lenders in. Current kernel code first, whatever the dtype.
    Then the problem's own dtype before the sibling's. In the problem's own bucket (the unit a
    config is shared in) a measurement comes before an estimate, even of the exact problem: the cost
    model errs by more than tuning gains, and an estimate table exported beside the shipped one must
    not shadow its measurements; then the rung. Beyond the bucket the closest problem comes first
    (4100 tokens borrow from 4096 before 16384), a measurement before an estimate only at equal
    distance. The problem key breaks ties."""

    def rank(lender: Lender) -> tuple:
        own_bucket = lender.rung < Rung.NEAREST
        estimate = lender.entry.is_estimate
        return (
            not lender.current,
            lender.sibling,
            not own_bucket,
            own_bucket and estimate,
            lender.rung,
            lender.closeness,
            estimate,
            lender.entry.problem_key,
        )

    return sorted(found, key=rank)


def for_warm_start(found: list[Lender]) -> list[Lender]:
    """The order a search enqueues its neighbours' best configs in: the nearest bucket first, at
    equal distance the problem's own dtype, then current kernel code; the problem key breaks
    ties."""
    return sorted(
        found,
        key=lambda lender: (
            lender.bucket_distance,
            lender.sibling,
            not lender.current,
            lender.entry.problem_key,
        ),
    )
