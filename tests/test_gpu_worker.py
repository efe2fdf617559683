"""The measuring worker's correctness gate (gpu_worker.measure) on the CPU, in this process: the
real function, with CPU stand-ins for the device (inputs, synchronize, L2 flush, CUDA-event timing)
and for the kernel (the forward family's attention_forward). A kernel that is right on its first
launch only (later launches write nothing: the poison stays) is caught by the check after the timed
runs; one that is wrong from the start, or never writes, is caught by the first check, whatever
outputs an earlier candidate left in the kept buffers."""

from __future__ import annotations

import pytest
import torch

from fa4tune.kernels.common.measure import AttentionCase
from fa4tune.kernels.common.reference import attention_reference
from fa4tune.kernels.common.verify import TOLERANCES
from fa4tune.kernels.fa4_fwd_sm90 import launch as fwd_launch
from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
from fa4tune.measure import gpu_worker, timing
from fa4tune.problem import Problem

PROBLEM = Problem(
    head_dim=64, causal=True, seqlen_q=96, seqlen_k=128, batch=2, nheads_q=4, nheads_kv=2
)
TIMED_RUNS = 3  # launches per fake timing (cheap and full alike)


def request(mode: str = "search") -> dict:
    tolerance = TOLERANCES["bf16"]
    return {
        "op": "measure",
        "problem": PROBLEM.to_dict(),
        "config": FwdConfig().to_dict(),
        "target": "H200",
        "mode": mode,
        "seed": 7,
        "tolerance": {"out": tolerance.out, "lse": tolerance.lse},
    }


class RecordingChannel:
    """The worker's side of the pipe: phases entered, questions asked (answered None: go on)."""

    def __init__(self) -> None:
        self.phases, self.asked = [], []

    def phase(self, name: str) -> None:
        self.phases.append(name)

    def ask(self, payload):
        self.asked.append(payload)
        return None


class StandInKernel:
    """attention_forward's stand-in: `writes(launch)` says whether launch number `launch` (from 0)
    writes O and the LSE (the fp32 reference, rounded to O's dtype, times `out_factor`)."""

    def __init__(
        self,
        writes=lambda launch: True,
        out_factor: float = 1.0,
        writes_lse: bool = True,
        writes_out: bool = True,
    ) -> None:
        self.writes, self.out_factor = writes, out_factor
        self.writes_out, self.writes_lse = writes_out, writes_lse
        self.launches = 0

    def __call__(
        self, q, k, v, config, causal=False, softmax_scale=None, out=None, lse=None, target=None
    ):
        launch, self.launches = self.launches, self.launches + 1
        if not self.writes(launch):
            return out, lse
        ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
        if self.writes_out:
            out.copy_(ref_out * self.out_factor)
        if self.writes_lse:
            lse.copy_(ref_lse)
        return out, lse


def cpu_case(family, problem, state: dict):
    """gpu_worker._case on the CPU: q, k, v, out, lse, kept in `state` while the problem stays."""
    key = problem.key()
    if state.get("case", (None,))[0] != key:
        p, dtype = problem, torch.bfloat16
        state["case"] = (
            key,
            AttentionCase(
                problem,
                torch.empty(p.batch, p.seqlen_q, p.nheads_q, p.head_dim, dtype=dtype),
                torch.empty(p.batch, p.seqlen_k, p.nheads_kv, p.head_dim, dtype=dtype),
                torch.empty(p.batch, p.seqlen_k, p.nheads_kv, p.head_dim_v, dtype=dtype),
                torch.empty(p.batch, p.seqlen_q, p.nheads_q, p.head_dim_v, dtype=dtype),
                torch.empty(p.batch, p.nheads_q, p.seqlen_q, dtype=torch.float32),
            ),
        )
    return state["case"][1]


def fake_time_cuda(fn, *, flusher=None, **options) -> timing.Timing:
    """time_cuda without CUDA events: TIMED_RUNS launches, each after a flush, at a made-up
    0.1 ms."""
    for _ in range(TIMED_RUNS):
        if flusher is not None:
            flusher()
        fn()
    return timing.Timing(median_ms=0.1, spread=0.01, runs=TIMED_RUNS, min_ms=0.09)


@pytest.fixture
def cpu_worker(monkeypatch):
    """gpu_worker.measure(request, channel, state) runnable on the CPU; the caller plants the kernel
    by standing in for the family's attention_forward."""
    monkeypatch.setattr(
        gpu_worker,
        "_kernel",
        lambda request, family, problem, config, target: (object(), 0.0, "test"),
    )
    monkeypatch.setattr(gpu_worker, "_case", cpu_case)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *device: None)
    monkeypatch.setattr(timing, "L2Flusher", lambda device=None: lambda: None)
    monkeypatch.setattr(timing, "time_cuda", fake_time_cuda)

    def measure(kernel: StandInKernel, state: dict | None = None, mode: str = "search") -> dict:
        monkeypatch.setattr(fwd_launch, "attention_forward", kernel)
        channel = RecordingChannel()
        result = gpu_worker.measure(request(mode), channel, {} if state is None else state)
        assert channel.phases == ["run"]
        return result

    return measure


@pytest.mark.parametrize("mode", ["search", "retime"])
def test_a_correct_kernel_is_ok_after_every_launch_was_checked(cpu_worker, mode):
    kernel = StandInKernel()
    result = cpu_worker(kernel, mode=mode)
    assert result["status"] == "ok", result
    assert result["time_ms"] == 0.1 and result["runs"] == TIMED_RUNS
    assert (
        result["out_error"] < TOLERANCES["bf16"].out
        and result["lse_error"] < TOLERANCES["bf16"].lse
    )
    timings = 2 if mode == "search" else 1  # cheap and full, or full alone
    assert kernel.launches == 1 + timings * TIMED_RUNS + 1, (
        "the first check, the timed runs, the check after"
    )


@pytest.mark.parametrize("mode", ["search", "retime"])
def test_a_kernel_whose_later_launches_write_nothing_is_wrong_after_the_timed_runs(
    cpu_worker, mode
):
    """The stale kernel: the first launch is right, and the timed runs would not show that the
    others write nothing; the poisoned check after them does."""
    result = cpu_worker(StandInKernel(writes=lambda launch: launch == 0), mode=mode)
    assert result["status"] == "wrong", result
    assert result["reason"].startswith(f"after {TIMED_RUNS} timed runs: NaN in the output"), result[
        "reason"
    ]


def test_a_kernel_wrong_from_the_start_is_wrong_before_any_timing(cpu_worker):
    kernel = StandInKernel(out_factor=1.1)
    result = cpu_worker(kernel)
    assert result["status"] == "wrong" and result["reason"].startswith("output error"), result
    assert result["out_error"] == pytest.approx(0.1, rel=0.05)
    assert kernel.launches == 1, "a wrong kernel was timed"


@pytest.mark.parametrize(
    "unwritten",
    [{"writes": lambda launch: False}, {"writes_out": False}, {"writes_lse": False}],
    ids=["nothing", "out", "lse"],
)
def test_outputs_an_earlier_candidate_left_are_poisoned_before_the_check(cpu_worker, unwritten):
    """The worker keeps the outputs from one candidate to the next (same problem, same seed: the
    same inputs); an earlier correct candidate's O and LSE must not pass for a kernel that leaves
    them unwritten."""
    state: dict = {}
    assert cpu_worker(StandInKernel(), state)["status"] == "ok"
    result = cpu_worker(StandInKernel(**unwritten), state)
    assert result["status"] == "wrong", result
    assert result["reason"].startswith("NaN in the "), result["reason"]
