"""Where one call's GPU time goes, for the benchmarks that show it (backward.py, decode.py).

A call is run PROFILED_CALLS times under torch.profiler (CUDA activity only), the L2 flushed before
each run outside the profile. Of each run: every GPU kernel's (and memset's or copy's) name, start
and end. Each kernel's time is summed by phase, the phase named by the benchmark's table of
(phase, a piece of the kernel's name); the first piece found in a name wins, and a kernel no piece
names is "other". A kernel's time excludes the gaps between launches, so the phases can add up to
less than the timed call (or to more, where kernels overlap, as a programmatic dependent launch
does). The call's span, from its first kernel's start to its last kernel's end, includes them:
span minus the phases' sum is the gaps less the overlap. Of both, the median over the calls."""

from __future__ import annotations

import statistics
import sys

PROFILED_CALLS = 3


def phase_of(kernel: str, table) -> str:
    """The phase of a GPU kernel named `kernel`: that of the first (phase, piece) of `table` whose
    piece is in the name, else "other"."""
    return next((phase for phase, piece in table if piece in kernel), "other")


def medians(per_call) -> dict:
    """{key: the median over the calls} of each call's {key: value}; a key that a call lacks counts
    0.0 there (a phase with no kernel in that call took no time)."""
    per_call = list(per_call)
    if not per_call:
        raise ValueError("medians of no calls")
    keys = sorted({key for values in per_call for key in values})
    return {key: statistics.median(values.get(key, 0.0) for values in per_call) for key in keys}


def phase_times(calls, table) -> dict:
    """{phase: median µs over the calls} from each call's list of (kernel name, µs), the phases
    named by `table` (phase_of)."""
    per_call = []
    for kernels in calls:
        total = {}
        for name, us in kernels:
            phase = phase_of(name, table)
            total[phase] = total.get(phase, 0.0) + us
        per_call.append(total)
    return medians(per_call)


def kernel_times(events) -> list:
    """(kernel name, µs) of each (name, start µs, end µs) event of a call."""
    return [(name, end - start) for name, start, end in events]


def span_us(events) -> float:
    """µs from the first kernel's start to the last kernel's end of a call's (name, start µs,
    end µs) events: its GPU time with the gaps between launches, each overlap counted once."""
    if not events:
        raise ValueError("the span of a call with no GPU kernel")
    return max(end for _, _, end in events) - min(start for _, start, _ in events)


def profiled_events(fn, flusher) -> list:
    """(kernel name, start µs, end µs) of every GPU kernel (and memset or copy) that one call of fn
    launches, as the profiler lists them; the L2 flushed before it, outside the profile."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    flusher()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == DeviceType.CUDA
    ]


def profile_call(fn, flusher, table, calls: int = PROFILED_CALLS) -> dict:
    """{"phases_us": {phase: µs}, "span_us": µs} of `calls` profiled calls of fn (profiled_events),
    each the median over the calls; the phases named by `table` (phase_of). A call in which the
    profiler saw no GPU kernel is an error: its phases would read as free."""
    if calls < 1:
        raise ValueError(f"profile_call needs at least one call, not {calls}")
    runs = [profiled_events(fn, flusher) for _ in range(calls)]
    if not all(runs):
        raise RuntimeError(
            "torch.profiler recorded no GPU kernel in a profiled call (is CUPTI available, and "
            "does the call run on the GPU?)"
        )
    return {
        "phases_us": phase_times((kernel_times(events) for events in runs), table),
        "span_us": statistics.median(span_us(events) for events in runs),
    }


def profile_into(cell: dict, fn, flusher, table, calls: int = PROFILED_CALLS) -> None:
    """profile_call's phases and span into a report's cell; where profiling fails (no CUPTI on the
    host, a kernel that fails only under the profiler), the cell says why instead
    (`profile_error`, also on stderr), so that the report's other columns and problems still come
    out: the phase table then shows '-' for it."""
    try:
        cell.update(profile_call(fn, flusher, table, calls))
    except Exception as exc:  # noqa: BLE001 - one cell says so; the report goes on
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        cell["profile_error"] = why
        print(f"kernel_phases: profiling failed: {why}", file=sys.stderr, flush=True)
