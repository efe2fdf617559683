"""The one GPU timing routine: CUDA events around each launch, L2 flushed before every run, warm-up
to steady clocks first, median and spread over many runs."""

from __future__ import annotations

import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    median_ms: float
    spread: float  # (p75 - p25) / median: the relative noise of this measurement
    runs: int
    min_ms: float


class L2Flusher:
    """Overwrites a buffer twice the size of L2 so that no run reads its inputs from a warm cache."""

    def __init__(self, device=None):
        import torch

        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 0) or 64 * 2**20
        self.buffer = torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buffer.fill_(0x5A5A5A5A)


def time_cuda(fn, *, warmup_ms: float = 100.0, min_runs: int = 20, max_runs: int = 200,
              target_ms: float = 400.0, flush_l2: bool = True, flusher: L2Flusher | None = None) -> Timing:
    """Time `fn()` (which launches GPU work on the current stream).

    Warm-up runs continue until `warmup_ms` of GPU time has passed (clocks ramp up, caches of compiled
    code fill). Then each run is bracketed by its own pair of events, with an L2 flush before the start
    event; runs repeat until `target_ms` of measured time or `max_runs`, at least `min_runs`."""
    import torch

    flusher = flusher if flusher is not None or not flush_l2 else L2Flusher()
    start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    # Warm-up: also estimates one run's duration.
    spent, warm_runs = 0.0, 0
    while spent < warmup_ms or warm_runs < 3:
        start_evt.record()
        fn()
        end_evt.record()
        end_evt.synchronize()
        spent += start_evt.elapsed_time(end_evt)
        warm_runs += 1
        if warm_runs > 10000:
            break
    per_run = max(spent / warm_runs, 1e-3)
    runs = int(min(max_runs, max(min_runs, target_ms / per_run)))

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    for i in range(runs):
        if flusher is not None:
            flusher()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    samples = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    median = statistics.median(samples)
    q1 = samples[len(samples) // 4]
    q3 = samples[(3 * len(samples)) // 4]
    return Timing(median_ms=median, spread=(q3 - q1) / median if median > 0 else 0.0, runs=runs,
                  min_ms=samples[0])
