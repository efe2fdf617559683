"""The gpu backend and fa4tune.attention on a real GPU (skipped without one): a short search stores
a verified, confirmed best; fa4tune.attention matches the reference and runs the table's config; a
kernel exported by one process and loaded by another computes exactly what a fresh compile does."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

from conftest import poisoned_attention, write_job  # noqa: E402

from fa4tune.problem import Problem  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
quiet = lambda *a, **k: None  # noqa: E731


def test_short_real_search_stores_a_verified_confirmed_best(workdir):
    from fa4tune.db import ResultsDB
    from fa4tune.kernels.common.verify import TOLERANCES
    from fa4tune.tune.job import load_job
    from fa4tune.tune.search import run_search

    path = write_job(
        workdir,
        backend="gpu",
        target=None,
        spaces={
            "tiles": {"tile_m": [128], "tile_n": [96, 128, 160]},
            "pipeline": {"num_stages": [2, 3]},
        },
        sampler="grid",
        budget={"trials": 6},
        problems=[{"head_dim": 128, "seqlen_q": 2048, "batch": 2, "nheads_q": 8, "causal": True}],
        measure={
            "confirm_top": 2,
            "confirm_rounds": 2,
            "compile_workers": 2,
            "cache_dir": str(workdir / "kernels"),
        },
    )
    summary = run_search(load_job(path), say=quiet)
    assert not summary.is_estimate and summary.backend == "gpu"
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        trials = db.trials()
        [best] = db.best_configs()
        [run] = db.runs()
    search = [t for t in trials if t["source"] != "confirm"]
    assert all(t["status"] in ("ok", "stopped", "pruned") for t in search), [
        t["reason"] for t in search
    ]
    ok = [t for t in search if t["status"] == "ok"]
    assert ok and all(t["max_error"] <= TOLERANCES["bf16"].out for t in ok)
    assert all(t["spread_ms"] is not None and t["spread_ms"] < 0.2 * t["time_ms"] for t in ok), (
        "noisy timings"
    )
    confirms = [t for t in trials if t["source"] == "confirm"]
    # The best two, and the default beside them when it is not one of them.
    assert min(2, len(ok)) <= len(confirms) <= min(2, len(ok)) + 1
    assert all(len(c["details"]["rounds_ms"]) == 2 for c in confirms)
    assert not best.is_estimate and best.config in [c["config"] for c in confirms]
    fastest = min(c["time_ms"] for c in confirms if c["status"] == "ok")
    kept = best.provenance.get("kept_default")
    if kept is None:
        assert best.time_ms == fastest
    else:  # the default was confirmed too, and nothing beat it by min_gain in every round
        assert best.time_ms >= fastest
        won, compared = kept["rounds_won"]
        assert kept["fastest_gain"] <= kept["min_gain"] or won < compared == 2
    assert run["gpu_name"] and run["sm_count"] and run["cuda_version"] and run["dsl_version"]
    assert any(t["details"].get("compiled_by") == "pool" for t in ok), (
        "the compile pool handed over no kernel"
    )


SHAPES = [
    # (head_dim, causal, seqlen_q, seqlen_k, batch, nheads_q, nheads_kv, softmax_scale)
    (128, False, 1000, 1000, 2, 4, 4, None),
    (128, True, 777, 1029, 2, 8, 2, None),  # GQA, seqlen_q < seqlen_k
    (64, True, 2048, 2048, 1, 4, 1, 0.05),  # MQA, own scale
    (64, False, 113, 113, 3, 2, 2, None),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "d{}-{}-q{}k{}-b{}h{}x{}".format(*s[:7]))
def test_attention_matches_the_reference(shape):
    d, causal, sq, sk, b, hq, hkv, scale = shape
    q = torch.randn(b, sq, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16)
    for attempt in range(2):  # the second call runs the prepared launch with new data
        if attempt:
            q.normal_(), k.normal_(), v.normal_()
        out, lse = poisoned_attention(q, k, v, causal=causal, softmax_scale=scale)
        assert (
            out.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq) and lse.dtype == torch.float32
        )
        assert_matches_reference(out, lse, q, k, v, causal, scale)


def assert_matches_reference(out, lse, q, k, v, causal: bool, softmax_scale: float | None = None):
    """O and the LSE of fa4tune.attention(q, k, v, causal, softmax_scale) against the fp32
    reference, within the tolerance of q's dtype."""
    from fa4tune.kernels.common.reference import attention_reference
    from fa4tune.kernels.common.verify import TOLERANCES

    tolerance = TOLERANCES["bf16" if q.dtype == torch.bfloat16 else "fp16"]
    ref_out, ref_lse = attention_reference(q, k, v, causal=causal, softmax_scale=softmax_scale)
    assert ((out.float() - ref_out).norm() / ref_out.norm()).item() < tolerance.out
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - ref_lse[finite]).abs().max().item() < tolerance.lse


def test_repeated_calls_on_one_shape_launch_with_each_calls_tensors_scale_and_causality():
    """A shape's prepared launch is taken again by every later call: each must launch with its own
    q, k and v (the earlier ones kept, so that new tensors get new memory), its own softmax_scale
    and its own causality, and match the reference of exactly that call."""
    from fa4tune.runtime import dispatch

    def new_inputs():
        return tuple(
            torch.randn(2, 1000, heads, 128, device="cuda", dtype=torch.bfloat16)
            for heads in (8, 2, 2)
        )

    dispatch.clear()
    held = []
    for _ in range(3):
        q, k, v = new_inputs()
        assert_matches_reference(*poisoned_attention(q, k, v, causal=True), q, k, v, True)
        held.append((q, k, v))
    assert len({t.data_ptr() for inputs in held for t in inputs}) == 3 * len(held)
    q, k, v = held[0]
    outputs = {}
    for scale in (None, 0.05, 0.3, None):
        outputs[scale], lse = poisoned_attention(q, k, v, softmax_scale=scale)
        assert_matches_reference(outputs[scale], lse, q, k, v, False, scale)
    assert not torch.equal(outputs[None], outputs[0.05])
    for causal in (False, True, False, True):
        assert_matches_reference(*poisoned_attention(q, k, v, causal=causal), q, k, v, causal)
    assert len(dispatch._LAUNCHES) == 4  # (causal, scale): (True, None), (False, each scale)
    dispatch.clear()


def test_poisoned_attention_shows_a_launch_that_writes_nothing(monkeypatch):
    """After correct calls, a prepared launch that launches nothing leaves the poison in its
    outputs, not what the earlier calls left in that memory, and poisoned_attention says so."""
    from fa4tune.runtime import dispatch

    q, k, v = (torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    dispatch.clear()
    for _ in range(2):
        assert_matches_reference(*poisoned_attention(q, k, v), q, k, v, False)
    [launch] = dispatch._LAUNCHES.values()
    monkeypatch.setattr(launch, "_run", lambda: 0)  # "launched", and nothing ran
    with pytest.raises(AssertionError, match="NaN in the output"):
        poisoned_attention(q, k, v)
    dispatch.clear()


def _tuned_db_in_use(problem, workdir, monkeypatch):
    """A results DB in workdir holding one measured best for `problem` on this GPU (the default
    with tile_n 96 and three stages), made the lookup's source; the kernel and that config."""
    import fa4tune
    from fa4tune.db import ResultsDB
    from fa4tune.kernels import get_kernel
    from fa4tune.measure.base import Measurement
    from fa4tune.runtime import dispatch
    from fa4tune.target import detect_target

    kernel, target = get_kernel(), detect_target()
    tuned = {**kernel.default_config(problem, target).to_dict(), "tile_n": 96, "num_stages": 3}
    with ResultsDB.open(str(workdir / "tuned.db")) as db:
        run = db.start_run(
            job_name="j",
            kernel=kernel.name,
            kernel_hash=kernel.source_hash(),
            target=target.name,
            backend="gpu",
            is_estimate=False,
            fa4tune_version="0",
            study_prefix="p",
        )
        db.add_trial(
            run_id=run,
            study_name="s",
            optuna_number=0,
            kernel=kernel.name,
            kernel_hash=kernel.source_hash(),
            target=target.name,
            problem=problem,
            config=tuned,
            measurement=Measurement.ok(problem, 0.1),
            source="sampler",
            provenance={},
        )
    monkeypatch.setenv("FA4TUNE_DB", str(workdir / "tuned.db"))
    fa4tune.runtime.reset()
    dispatch.clear()
    return kernel, tuned


def test_fp16_runs_the_config_tuned_for_bf16(workdir, monkeypatch):
    """A DB that holds a bf16 problem only: an fp16 call of that shape takes its config (the
    sibling-dtype rung), launches it, and matches the reference at fp16's tolerance."""
    import fa4tune
    from fa4tune.kernels.common.reference import attention_reference
    from fa4tune.kernels.common.verify import TOLERANCES
    from fa4tune.runtime import dispatch

    problem = Problem(head_dim=128, causal=True, seqlen_q=1536, batch=2, nheads_q=8, nheads_kv=2)
    _, tuned = _tuned_db_in_use(problem, workdir, monkeypatch)
    q = torch.randn(2, 1536, 8, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 1536, 2, 128, device="cuda", dtype=torch.float16) for _ in range(2))
    hit = dispatch.explain(q, k, v, causal=True)
    assert (hit.source, hit.problem_key, hit.config.to_dict()) == (
        "other-dtype",
        problem.key(),
        tuned,
    )
    out, lse = poisoned_attention(q, k, v, causal=True)
    [launch] = dispatch._LAUNCHES.values()
    assert launch.config.to_dict() == tuned
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    tolerance = TOLERANCES["fp16"]
    assert ((out.float() - ref_out).norm() / ref_out.norm()).item() < tolerance.out
    assert (lse - ref_lse).abs().max().item() < tolerance.lse
    dispatch.clear()
    fa4tune.runtime.reset()


@pytest.mark.parametrize("causal", [False, True])
def test_inputs_with_nothing_to_compute_give_zero_and_minus_inf(causal, monkeypatch):
    """No batch, no query rows or no keys: O zero and LSE -inf on the tensors' device and current
    stream, as in flash-attn-4, with no kernel compiled; attention_forward fills a caller's out and
    lse."""
    import fa4tune
    from fa4tune.kernels.common.inputs import UnsupportedInput
    from fa4tune.kernels.fa4_fwd_sm90 import launch as fwd_launch
    from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward
    from fa4tune.runtime import dispatch

    def no_compile(*args, **kwargs):
        raise AssertionError("an empty input compiled a kernel")

    monkeypatch.setattr(fwd_launch, "compile_forward", no_compile)
    dispatch.clear()
    stream = torch.cuda.Stream()
    for b, sq, sk in ((2, 100, 0), (2, 0, 100), (0, 100, 100)):
        q = torch.randn(b, sq, 4, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, sk, 2, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, sk, 2, 64, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):  # the second call takes the prepared path
            with torch.cuda.stream(stream):
                out, lse = fa4tune.attention(q, k, v, causal=causal)
            stream.synchronize()
            assert (
                out.shape == (b, sq, 4, 64)
                and out.dtype == torch.bfloat16
                and out.device == q.device
            )
            assert lse.shape == (b, 4, sq) and lse.dtype == torch.float32 and lse.device == q.device
            assert torch.all(out == 0) and torch.all(lse == -math.inf)
        out = torch.full((b, sq, 4, 64), float("nan"), device="cuda", dtype=torch.bfloat16)
        lse = torch.full((b, 4, sq), float("nan"), device="cuda")
        got = attention_forward(q, k, v, FwdConfig(), causal=causal, out=out, lse=lse)
        assert (
            got[0] is out and got[1] is lse and torch.all(out == 0) and torch.all(lse == -math.inf)
        )
    # Written on the current stream: a CUDA graph captures the writes (work on another stream would
    # fail the capture), and its replay writes them again.
    q, k = (
        torch.randn(2, s, h, 128, device="cuda", dtype=torch.bfloat16)
        for s, h in ((100, 4), (0, 2))
    )
    fa4tune.attention(q, k, k, causal=causal)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = fa4tune.attention(q, k, k, causal=causal)
    out.fill_(float("nan")), lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.all(out == 0) and torch.all(lse == -math.inf)
    # Nothing is read: a q that does not start 16-byte aligned is no reason to refuse.
    odd = torch.randn(2 * 100 * 4 * 128 + 1, device="cuda", dtype=torch.bfloat16)[1:].view(
        2, 100, 4, 128
    )
    assert odd.data_ptr() % 16 and torch.all(fa4tune.attention(odd, k, k)[0] == 0)
    with pytest.raises(UnsupportedInput, match="at least one head"):
        fa4tune.attention(
            torch.randn(2, 0, 4, 128, device="cuda", dtype=torch.bfloat16),
            *(torch.randn(2, 8, 0, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2)),
        )


def test_attention_runs_the_tables_config_on_the_current_stream(workdir, monkeypatch):
    import fa4tune
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward
    from fa4tune.runtime import dispatch

    problem = Problem(head_dim=128, causal=True, seqlen_q=1536, batch=2, nheads_q=4)
    kernel, tuned = _tuned_db_in_use(problem, workdir, monkeypatch)
    q, k, v = (torch.randn(2, 1536, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    assert dispatch.explain(q, k, v, causal=True).config.to_dict() == tuned
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out, lse = poisoned_attention(q, k, v, causal=True)
    side.synchronize()
    [launch] = dispatch._LAUNCHES.values()
    assert launch.config.to_dict() == tuned
    expected, expected_lse = attention_forward(q, k, v, kernel.config(tuned), causal=True)
    torch.cuda.synchronize()
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse), (
        "not the table's kernel, or not the same run"
    )
    dispatch.clear()
    fa4tune.runtime.reset()


def test_attention_runs_on_a_hopper_gpu_without_a_description(monkeypatch):
    """An H20, say: the H200 here, under another name and with 66 SMs: default configs, a persistent
    grid sized to 66 SMs, results matching the reference."""
    import types

    from fa4tune.kernels.common.reference import attention_reference
    from fa4tune.kernels.fa4_fwd_sm90.compile import _CACHE
    from fa4tune.runtime import dispatch

    real = torch.cuda.get_device_properties

    def renamed(device=None):
        props = real(device)
        return types.SimpleNamespace(
            name="NVIDIA H20 (test)",
            major=props.major,
            minor=props.minor,
            multi_processor_count=66,
            L2_cache_size=getattr(props, "L2_cache_size", None),
        )

    monkeypatch.setattr(torch.cuda, "get_device_properties", renamed)
    monkeypatch.setattr(dispatch, "_UNDESCRIBED_SEEN", set())
    dispatch.clear()
    q, k, v = (torch.randn(2, 3000, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with pytest.warns(RuntimeWarning, match="NVIDIA H20 \\(test\\) is a Hopper GPU"):
        out, lse = poisoned_attention(q, k, v, causal=True)
    [launch] = dispatch._LAUNCHES.values()
    assert launch.config.persistent and dispatch.explain(q, k, v, causal=True).source == "default"
    assert launch.l2_group.value >= 1 and any(
        key[-1] == 66 for key in _CACHE
    )  # compiled for 66 SMs
    ref_out, ref_lse = attention_reference(q, k, v, causal=True)
    assert ((out.float() - ref_out).norm() / ref_out.norm()).item() < 1e-2
    assert (lse - ref_lse).abs().max().item() < 1e-3
    dispatch.clear()


def test_kernel_exported_in_another_process_equals_a_fresh_compile(workdir):
    from fa4tune.kernels.fa4_fwd_sm90.compile import _CACHE, compile_forward, load_compiled
    from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward

    config = FwdConfig(tile_n=112, num_stages=3, rescale_threshold=4.0)
    path = workdir / "kernel.o"
    # The exporting process sees no GPU, like a compile worker.
    script = (
        "from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig\n"
        "from fa4tune.kernels.fa4_fwd_sm90.compile import compile_forward, export_compiled\n"
        "export_compiled(compile_forward("
        "FwdConfig(tile_n=112, num_stages=3, rescale_threshold=4.0), "
        f"'bf16', 128, 128, True, 'H200'), {str(path)!r})\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=600)
    fresh = compile_forward(config, "bf16", 128, 128, True, "H200", use_cache=False)
    _CACHE.pop(fresh.key, None)
    loaded = load_compiled(path, config, "bf16", 128, 128, True, "H200")
    assert loaded.kernel is None and loaded.compile_seconds < 1.0
    q, k, v = (torch.randn(2, 1000, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out_loaded, lse_loaded = attention_forward(
        q, k, v, config, causal=True
    )  # the cache holds the loaded one
    _CACHE[fresh.key] = fresh
    out_fresh, lse_fresh = attention_forward(q, k, v, config, causal=True)
    torch.cuda.synchronize()
    _CACHE.pop(fresh.key, None)
    assert torch.equal(out_loaded, out_fresh) and torch.equal(lse_loaded, lse_fresh)


def test_a_dirty_l2_flush_overwrites_twice_the_l2_on_the_gpu():
    from fa4tune.measure.timing import L2Flusher

    flusher = L2Flusher(mode="dirty")
    l2 = torch.cuda.get_device_properties(None).L2_cache_size
    assert flusher.buffer.is_cuda and flusher.buffer.numel() * 4 >= 2 * l2
    flusher()
    torch.cuda.synchronize()
    assert int(flusher.buffer[-1]) == 0x5A5A5A5A


def test_the_default_l2_flush_reads_twice_the_l2_on_the_gpu(monkeypatch):
    from fa4tune.measure.timing import FLUSH_ENV, L2Flusher

    monkeypatch.delenv(FLUSH_ENV, raising=False)
    flusher = L2Flusher()
    assert flusher.mode == "clean"
    l2 = torch.cuda.get_device_properties(None).L2_cache_size
    assert flusher.buffer.numel() * 4 >= 2 * l2
    flusher()
    torch.cuda.synchronize()
    assert int(flusher.sink) == 0 and int(flusher.buffer[-1]) == 0
