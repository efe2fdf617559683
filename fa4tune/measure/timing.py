"""The one GPU timing routine: CUDA events around each launch, L2 flushed before every run, warm-up
to steady clocks first, median and spread over many runs.

Between the flush and the start event the GPU is kept busy by a spin kernel, so that the host-side
work of the launch under test (argument conversion, driver calls) is hidden: the events then bracket
GPU execution only. Host dispatch cost is measured separately (benchmarks/dispatch.py)."""

from __future__ import annotations

import gc
import os
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Timing:
    median_ms: float
    spread: float  # (p75 - p25) / median: the relative noise of this measurement
    runs: int
    min_ms: float


HOST_HIDE_SECONDS = 1e-3  # well above any launch's host-side preparation we have measured (~140 µs)


# How the flush leaves L2 (FA4TUNE_L2_FLUSH; flush_mode). "clean", the default, reads the buffer:
# L2 then holds clean lines, which the timed run's reads evict for nothing, as in serving, where a
# decode step follows GEMMs that only read their weights. "dirty" overwrites the buffer, leaving up
# to L2's size of dirty lines whose write-back lands in the timed run (60 MB on an H200, about 14 µs
# at 4.24 TB/s): an artifact of the flush, not of the workload. On an H200 it made decode's main
# kernel 42.6 µs instead of 33.2 µs (hd128, 32k, batch 1; the copy floor 31.7 µs), hd64 at 131k
# 72.7 instead of 62.4 µs, and slowed cuDNN's decode too; compute-bound prefill and backward barely
# move. Times of the two modes do not compare: a search records its mode and never mixes them.
FLUSH_ENV = "FA4TUNE_L2_FLUSH"
FLUSH_MODES = ("dirty", "clean")
# The mode of times that do not record theirs (runs, table entries, benchmark JSON).
UNRECORDED_FLUSH = "dirty"
NO_FLUSH = "none"  # what a cost model's estimates record: nothing is timed, nothing flushed


class FlushModeError(ValueError):
    """An L2 flush mode that is not one of FLUSH_MODES."""


def flush_mode() -> str:
    """The L2 flush's mode: FA4TUNE_L2_FLUSH if set (one of FLUSH_MODES), else "clean"."""
    mode = os.environ.get(FLUSH_ENV, "clean")
    return _known_mode(mode, f"{FLUSH_ENV}={mode!r}")


def _known_mode(mode: str, named: str) -> str:
    if mode not in FLUSH_MODES:
        raise FlushModeError(f"{named}: want one of {', '.join(FLUSH_MODES)}")
    return mode


class L2Flusher:
    """Sweeps a buffer twice the size of L2 so no run reads its inputs from a warm cache: overwrites
    it ("dirty") or reads it ("clean"); `mode` defaults to flush_mode()."""

    def __init__(self, device=None, mode: str | None = None):
        import torch

        self.mode = flush_mode() if mode is None else _known_mode(mode, f"L2Flusher mode {mode!r}")
        # On the GPU (the current one unless told): a buffer made with device=None would be host
        # memory, and filling it would leave L2 as warm as it was.
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if device is None
            else torch.device(device)
        )
        if device.type != "cuda":
            raise ValueError(f"L2Flusher needs a CUDA device, got {device}")
        props = torch.cuda.get_device_properties(device)
        l2 = getattr(props, "L2_cache_size", 0) or 64 * 2**20
        self.buffer = torch.empty(2 * l2 // 4, dtype=torch.int32, device=device)
        self.sink = torch.zeros((), dtype=torch.int64, device=device)  # the clean sweep's sum
        if self.mode == "clean":
            self.buffer.zero_()

    def __call__(self) -> None:
        import torch

        if self.mode == "dirty":
            self.buffer.fill_(0x5A5A5A5A)
        else:
            torch.sum(self.buffer, dim=0, out=self.sink)


def round_order(count: int, round_index: int) -> list[int]:
    """The order in which interleaved round `round_index` times `count` candidates: each round
    starts one later, so that none is always timed first or last (rounds compared pairwise stay
    fair)."""
    return [(round_index + step) % count for step in range(count)]


def _spin_cycles() -> int:
    import torch

    clock_khz = getattr(torch.cuda.get_device_properties(None), "clock_rate", 0) or 2_000_000
    return int(HOST_HIDE_SECONDS * clock_khz * 1e3)


def time_cuda(
    fn,
    *,
    warmup_ms: float = 100.0,
    min_runs: int = 20,
    max_runs: int = 200,
    target_ms: float = 400.0,
    flush_l2: bool = True,
    flusher: L2Flusher | None = None,
) -> Timing:
    """Time `fn()` (which launches GPU work on the current stream).

    Warm-up runs continue until `warmup_ms` of GPU time has passed (clocks ramp up, caches of
    compiled code fill). Then each run is bracketed by its own pair of events, with an L2 flush
    before the start event; runs repeat until `target_ms` of measured time or `max_runs`, at least
    `min_runs`."""

    # A garbage-collection pause in the host code of a launch could outlast the spin and leave the
    # GPU idle inside the timed interval; collect now and not during the measurement.
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        return _time_cuda(fn, warmup_ms, min_runs, max_runs, target_ms, flush_l2, flusher)
    finally:
        if gc_was_enabled:
            gc.enable()


def _time_cuda(fn, warmup_ms, min_runs, max_runs, target_ms, flush_l2, flusher) -> Timing:
    import torch

    flusher = flusher if flusher is not None or not flush_l2 else L2Flusher()
    start_evt, end_evt = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    # Warm-up in batches without a host sync per run, so the GPU stays busy and its clocks ramp up;
    # this also estimates one run's duration.
    spent, warm_runs, batch = 0.0, 0, 1
    while spent < warmup_ms or warm_runs < 3:
        start_evt.record()
        for _ in range(batch):
            fn()
        end_evt.record()
        end_evt.synchronize()
        spent += start_evt.elapsed_time(end_evt)
        warm_runs += batch
        batch = min(batch * 2, 64)
        if warm_runs > 100000:
            break
    per_run = max(spent / warm_runs, 1e-3)
    runs = int(min(max_runs, max(min_runs, target_ms / per_run)))

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(runs)]
    spin = _spin_cycles()
    for i in range(runs):
        if flusher is not None:
            flusher()
        torch.cuda._sleep(spin)  # keeps the GPU busy while the host prepares fn's launch
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    samples = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    median = statistics.median(samples)
    q1 = samples[len(samples) // 4]
    q3 = samples[(3 * len(samples)) // 4]
    return Timing(
        median_ms=median,
        spread=(q3 - q1) / median if median > 0 else 0.0,
        runs=runs,
        min_ms=samples[0],
    )
