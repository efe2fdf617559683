"""benchmarks/tuning_report.py without a GPU: the search story read from a DB, the rendering of
missing peers and targets, and a clean refusal (exit 2, nothing written) where there is no GPU."""

import importlib.util
from pathlib import Path

from fa4tune.db import ResultsDB
from fa4tune.kernels import get_kernel
from fa4tune.measure.base import Measurement
from fa4tune.problem import Problem

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location(
    "tuning_report", REPO / "benchmarks" / "tuning_report.py"
)
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)

GRID = Problem(head_dim=128, seqlen_q=4096, batch=4, nheads_q=16)
KERNEL = get_kernel()
HEADER = {
    "kernel": "k",
    "target": "H200",
    "date": "d",
    "gpu": "NVIDIA H200",
    "driver": "580",
    "cuda": "13.0",
    "torch": "2.11",
    "dsl": "4.8.1",
    "fa4": "4.0.0b36",
    "kernel_hash": "abcdef0123456789",
    "db": "x.db",
    "rounds": 3,
}


def test_search_story_counts_trials_to_the_best(workdir):
    with ResultsDB.open("r.db") as db:
        run = db.start_run(
            job_name="j",
            kernel=KERNEL.name,
            kernel_hash="h",
            target="H200",
            backend="gpu",
            is_estimate=False,
            fa4tune_version="0",
            study_prefix="p",
        )
        times = [2.0, None, 1.5, 1.02, 1.3, 1.0, 1.4]  # None: an infeasible (pruned) suggestion
        for number, ms in enumerate(times):
            m = Measurement.pruned(["x"]) if ms is None else Measurement.ok(GRID, ms)
            db.add_trial(
                run_id=run,
                study_name="s",
                optuna_number=number,
                kernel=KERNEL.name,
                kernel_hash="h",
                target="H200",
                problem=GRID,
                config={"tile_n": number},
                measurement=m,
                source="sampler",
                provenance={},
            )
        [best] = db.best_configs()
        story = report.search_story(db, GRID.key(), best)
    # Measured (pruned skipped): 2.0, 1.5, 1.02 (within 2% of 1.0: trial 3), 1.3, 1.0 (the best:
    # trial 5).
    assert story["measured"] == 6 and story["to_near"] == 3 and story["to_best"] == 5


def test_render_says_what_is_missing():
    cells = {
        "default": {"tflops": 600.0},
        "tuned": {"tflops": 660.0},
        "flash-attn-4": "not installed (ModuleNotFoundError: flash_attn)",
        "flash-attn-4, O only": "not installed (ModuleNotFoundError: flash_attn)",
        "cuDNN": {"tflops": 610.0},
    }
    rows = [
        {
            "key": GRID.key(),
            "grid": True,
            "default": "128x128s2",
            "changed": "tile_n=160",
            "cells": cells,
            "story": {"measured": 30, "to_near": 12, "to_best": 20, "wall_s": 55.0, "stopped": 4},
        },
        {
            "key": "other",
            "grid": False,
            "default": "128x128s2",
            "note": "not tuned (no best config in the DB)",
        },
    ]
    text = report.render(rows, {**HEADER, "fa4": "not installed"})
    assert "**1.100x** (target ≥ 1.05)" in text
    assert "flash-attn-4 not measured" in text
    assert "not installed (ModuleNotFoundError: flash_attn)" in text
    assert "| 600 | 660 |" in text and "12 / 20 (30, 4 stopped)" in text and "not tuned" in text
    assert all(
        line.count("|") == text.splitlines()[-3].count("|") for line in text.splitlines()[-3:]
    )


def test_the_report_says_how_the_l2_flush_left_l2():
    """The header's flush mode (run_header: flush_mode, clean unless FA4TUNE_L2_FLUSH says dirty)
    in the report's first paragraph; a JSON written before the header had it was timed dirty."""
    first = report.render([], HEADER).split("## Summary")[0]
    assert (
        "overwrote a buffer twice its size (dirty lines" in first
        and "FA4TUNE_L2_FLUSH=dirty" in first
    )
    first = report.render([], {**HEADER, "flush": "clean"}).split("## Summary")[0]
    assert "read a buffer twice its size (clean lines" in first and "overwrote" not in first


def test_flash_attn_4_is_judged_by_the_column_that_writes_lse_too():
    """fa4tune writes O and LSE: the target compares it with flash-attn-4 doing the same; the O-only
    column (flash-attn-4's default) is shown beside it with its own ratio."""
    cells = {
        "default": {"tflops": 580.0},
        "tuned": {"tflops": 584.0},
        "flash-attn-4": {"tflops": 581.0},
        "flash-attn-4, O only": {"tflops": 587.0},
        "cuDNN": {"tflops": 480.0},
    }
    rows = [
        {
            "key": GRID.key(),
            "grid": True,
            "default": "192x128",
            "changed": "(default)",
            "cells": cells,
            "story": {"measured": 40, "to_near": 1, "to_best": 1, "wall_s": 27.0},
        }
    ]
    text = report.render(rows, HEADER)
    assert "(both writing O and LSE) on the grid: lowest **1.005x**, 1 of 1 shapes" in text
    assert "computing O only: lowest 0.995x, 0 of 1 shapes" in text
    assert "| 580 | 584 | 581 | 587 | 480 | 1.007 | 1.005 | 0.995 |" in text
    assert report.is_grid(GRID) and not report.is_grid(
        Problem(head_dim=128, seqlen_q=8192, batch=2, nheads_q=32, nheads_kv=8)
    )


def test_the_report_takes_its_peers_from_the_kernel_family(monkeypatch):
    """The peer columns are the family's peers; flash-attn-4 asked for its LSE must give one (a
    column without it would go unchecked), and a peer that cannot run says why in its cell."""
    import pytest

    from fa4tune.kernels import PeerUnavailable
    from fa4tune.kernels.fa4_fwd_sm90 import FAMILY, peers

    assert [peer.name for peer in FAMILY.peers()][: len(report.COLUMNS) - 2] == list(
        report.COLUMNS[2:]
    )

    def fake_fa4(q, k, v, causal=False, return_lse=False):
        return ("o", "lse", None) if return_lse else "o"

    monkeypatch.setattr(peers, "_flash_attn_4", lambda: fake_fa4)
    assert peers.fa4_with_lse(GRID, "q", "k", "v")() == ("o", "lse")
    assert peers.fa4_o_only(GRID, "q", "k", "v")() == ("o", None)
    monkeypatch.setattr(peers, "_flash_attn_4", lambda: lambda *args, **kwargs: ("o", None))
    with pytest.raises(RuntimeError, match="no LSE"):
        peers.fa4_with_lse(GRID, "q", "k", "v")()

    def missing():
        raise PeerUnavailable("not installed (test)")

    monkeypatch.setattr(peers, "_flash_attn_4", missing)
    monkeypatch.setattr(report, "fa4tune_runner", lambda *args: "fa4tune column")
    shifted = Problem(head_dim=128, causal=True, seqlen_q=1024, seqlen_k=2048)
    runners = report.runners_for(shifted, None, None, None, "q", "k", "v", FAMILY)
    assert runners["flash-attn-4"] == runners["flash-attn-4, O only"] == "not installed (test)"
    assert runners["cuDNN"] == "n/a (SDPA's causal mask is top-left aligned)"


def test_without_a_gpu_it_refuses_and_writes_nothing(workdir, capsys):
    import pytest
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = workdir / "report.md"
    assert report.main(["--out", str(out)]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err and not out.exists()


def test_a_cudnn_column_with_repeated_kv_heads_says_so():
    """cuDNN's SDPA may refuse GQA; the report then times it with K/V heads repeated (more traffic
    than the problem has), and the cell must say so."""

    def cudnn():
        return None

    cudnn.gqa = {"native": False, "kv": ()}
    assert not report.gqa_native({"cuDNN": cudnn})
    cudnn.gqa = {"native": True, "kv": ()}
    assert report.gqa_native({"cuDNN": cudnn}) and report.gqa_native({"cuDNN": "n/a (...)"})
    assert (
        report.fmt_cell({"tflops": 629.4, "note": "K/V heads repeated"})
        == "629 (K/V heads repeated)"
    )
    assert report.fmt_cell({"tflops": 629.4}) == "629"


def test_columns_are_timed_in_interleaved_rounds(monkeypatch):
    """Each round starts one column later, and a column's time is the median of its rounds."""
    from types import SimpleNamespace

    from fa4tune.measure import timing

    order, times = [], {"a": iter([1.0, 3.0, 2.0]), "b": iter([4.0, 4.0, 5.0])}

    def fake_time_cuda(fn, flusher=None):
        order.append(fn.__name__)
        return SimpleNamespace(median_ms=next(times[fn.__name__]))

    monkeypatch.setattr(timing, "time_cuda", fake_time_cuda)
    monkeypatch.setattr(timing, "L2Flusher", lambda: None)

    def a():
        pass

    def b():
        pass

    cells = report.time_interleaved(GRID, {"a": a, "b": b}, rounds=3)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert cells["a"]["ms"] == 2.0 and cells["a"]["round_spread"] == 1.0 and cells["b"]["ms"] == 4.0
    assert cells["b"]["tflops"] == GRID.flops / 4e-3 / 1e12


def test_only_columns_that_pass_the_reference_are_timed(monkeypatch):
    """A column without a config keeps its reason; one that raises, is off, or leaves its poison is
    named and not timed; a right one (O alone, or O and LSE) is timed."""
    import torch

    from fa4tune.kernels.common.reference import attention_reference

    problem = Problem(head_dim=64, seqlen_q=64, seqlen_k=64, batch=1, nheads_q=2, causal=True)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 64, generator=gen, dtype=torch.bfloat16) for _ in range(3))
    right_o, right_lse = attention_reference(q, k, v, causal=True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    timed = []
    monkeypatch.setattr(
        report,
        "time_interleaved",
        lambda p, runners, rounds, flops=None: (
            timed.extend(runners),
            {name: {"ms": 1.0} for name in runners},
        )[1],
    )

    def unwritten():
        return torch.full_like(right_o, float("nan")), right_lse

    def raises():
        raise RuntimeError("no kernel for this shape\nmore")

    runners = {
        "absent": "not installed (x)",
        "both": lambda: (right_o, right_lse),
        "o only": lambda: right_o,
        "off": lambda: (right_o * 1.1, right_lse),
        "unwritten": unwritten,
        "raises": raises,
    }
    cells = report.verify_and_time(problem, runners, q, k, v, rounds=3)
    assert timed == ["both", "o only"]
    assert cells["absent"] == "not installed (x)"
    # A timed cell keeps its output's error against the fp32 reference (here the reference's own).
    assert cells["both"] == {"ms": 1.0, "out_error": 0.0} and cells["o only"]["out_error"] == 0.0
    assert cells["off"].startswith("wrong (") and "NaN in the output" in cells["unwritten"]
    assert cells["raises"] == "error: RuntimeError: no kernel for this shape"
