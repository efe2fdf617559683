"""benchmarks/kernel_phases.py without a GPU: kernels named by a phase table, the medians over
profiled calls, a call's span from its kernels' (name, start, end), and the profiling itself with
torch.profiler replaced by a fake that lists GPU and host events."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "kernel_phases", REPO / "benchmarks" / "kernel_phases.py"
)
phases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(phases)

TABLE = (("pre", "Preprocess"), ("main", "Sm90"), ("zero", "emset"))


def test_the_first_piece_found_names_the_phase():
    assert phases.phase_of("kernel_cutlass_kernel_BackwardPreprocessSm90_0", TABLE) == "pre"
    assert phases.phase_of("kernel_cutlass_kernel_FlashForwardSm90_object_at__0", TABLE) == "main"
    assert phases.phase_of("Memset (Device)", TABLE) == "zero"
    assert phases.phase_of("void at::native::reduce_kernel<sum>", TABLE) == "other"
    assert phases.phase_of("anything", ()) == "other"


def test_medians_over_calls_count_a_missing_key_as_zero():
    assert phases.medians([{"a": 1.0, "b": 4.0}, {"a": 3.0}, {"a": 2.0}]) == {"a": 2.0, "b": 0.0}
    assert phases.medians([{"a": 1.0, "b": 4.0}, {"a": 3.0}, {"b": 5.0}]) == {"a": 1.0, "b": 4.0}
    assert phases.medians([{"a": 1.0}, {"a": 4.0}]) == {"a": 2.5}  # an even count: the middle
    assert list(phases.medians([{"b": 1.0, "a": 1.0}])) == ["a", "b"]
    with pytest.raises(ValueError, match="no calls"):
        phases.medians([])


def test_phase_times_sum_each_calls_kernels_by_phase_then_take_the_median():
    call = [("x_Preprocess", 10.0), ("x_Sm90", 100.0), ("y_Sm90", 20.0), ("fill", 1.0)]
    slow = [(name, us * 2) for name, us in call]
    assert phases.phase_times([call, slow, call], TABLE) == {
        "main": 120.0,
        "other": 1.0,
        "pre": 10.0,
    }


def test_the_span_runs_from_the_first_start_to_the_last_end():
    # A gap of 5 µs between two kernels: the span is longer than their sum.
    apart = [("main", 100.0, 180.0), ("combine", 185.0, 190.0)]
    assert phases.span_us(apart) == 90.0
    assert sum(us for _, us in phases.kernel_times(apart)) == 85.0
    # A dependent launch started early overlaps the first kernel: the span is shorter than the sum,
    # and the listing's order does not matter.
    overlap = [("combine", 170.0, 190.0), ("main", 100.0, 180.0)]
    assert phases.span_us(overlap) == 90.0
    assert phases.kernel_times(overlap) == [("combine", 20.0), ("main", 80.0)]
    assert phases.span_us([("one", 3.0, 4.5)]) == 1.5
    with pytest.raises(ValueError, match="no GPU kernel"):
        phases.span_us([])


class FakeProfiler:
    """torch.profiler.profile as profiled_events uses it: a context manager whose events() lists
    what ran inside it; it records which activities it was asked for and whether the L2 flush
    happened before it started."""

    made, flushes = [], []

    def __init__(self, activities):
        self.activities = activities
        FakeProfiler.made.append(self)

    def __enter__(self):
        self.flushes_before = list(FakeProfiler.flushes)
        return self

    def __exit__(self, *exc):
        self.flushes_after = list(FakeProfiler.flushes)
        return False

    def events(self):
        from torch.autograd import DeviceType

        def event(name, device, start, end):
            return SimpleNamespace(
                name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end)
            )

        return [
            event("cudaLaunchKernel", DeviceType.CPU, 0.0, 3.0),
            event("kernel_main", DeviceType.CUDA, 10.0, 90.0),
            event("kernel_combine", DeviceType.CUDA, 85.0, 95.0),
        ]


@pytest.fixture
def fake_profiler(monkeypatch):
    import torch
    import torch.profiler

    FakeProfiler.made, FakeProfiler.flushes = [], []
    monkeypatch.setattr(torch.profiler, "profile", FakeProfiler)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    return FakeProfiler


def test_a_profiled_call_lists_its_gpu_kernels_with_the_flush_outside(fake_profiler):
    from torch.profiler import ProfilerActivity

    ran = []
    events = phases.profiled_events(
        lambda: ran.append("call"), lambda: fake_profiler.flushes.append("flush")
    )
    assert events == [("kernel_main", 10.0, 90.0), ("kernel_combine", 85.0, 95.0)]
    assert ran == ["call"]
    (prof,) = fake_profiler.made
    assert prof.activities == [ProfilerActivity.CUDA]
    assert prof.flushes_before == prof.flushes_after == ["flush"]


def test_profile_call_takes_the_medians_of_phases_and_span(monkeypatch, fake_profiler):
    assert phases.profile_call(lambda: None, lambda: None, (("main", "main"),)) == {
        "phases_us": {"main": 80.0, "other": 10.0},
        "span_us": 85.0,
    }
    assert len(fake_profiler.made) == phases.PROFILED_CALLS
    calls = iter(
        [
            [("k_main", 0.0, 10.0), ("k_comb", 12.0, 14.0)],
            [("k_main", 0.0, 30.0), ("k_comb", 40.0, 44.0)],
            [("k_main", 0.0, 20.0)],  # no combine in this call: 0 µs of it
        ]
    )
    monkeypatch.setattr(phases, "profiled_events", lambda fn, flusher: next(calls))
    got = phases.profile_call(None, None, (("combine", "comb"), ("main", "main")))
    assert got == {"phases_us": {"combine": 2.0, "main": 20.0}, "span_us": 20.0}
    with pytest.raises(ValueError, match="at least one call, not 0"):
        phases.profile_call(None, None, (), calls=0)
    monkeypatch.setattr(phases, "profiled_events", lambda fn, flusher: [])
    with pytest.raises(RuntimeError, match="no GPU kernel in a profiled call"):
        phases.profile_call(None, None, ())


def test_a_failed_profile_is_said_in_its_cell_and_the_report_goes_on(monkeypatch, capsys):
    """profile_into: the phases and span into the cell; where profiling fails (here: the profiler
    saw no GPU kernel), the cell gets why instead, and nothing is raised."""
    monkeypatch.setattr(phases, "profiled_events", lambda fn, flusher: [("k_main", 0.0, 10.0)])
    cell = {"ms": 0.01}
    phases.profile_into(cell, None, None, (("main", "main"),))
    assert cell == {"ms": 0.01, "phases_us": {"main": 10.0}, "span_us": 10.0}
    monkeypatch.setattr(phases, "profiled_events", lambda fn, flusher: [])
    cell = {"ms": 0.01}
    phases.profile_into(cell, None, None, (("main", "main"),))
    assert cell["profile_error"].startswith("RuntimeError: torch.profiler recorded no GPU kernel")
    assert "phases_us" not in cell
    assert "kernel_phases: profiling failed: RuntimeError" in capsys.readouterr().err
