"""benchmarks/decode.py's profile of a decode call without a GPU: its kernels' names sorted into
phases (the names the CuTe DSL gives the compiled kernels, on the CPU), which columns are profiled
(the GPU parts replaced by fakes), and the table of where the call's time goes, rendered from a
JSON like one a GPU run writes."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from fa4tune.kernels.fa4_fwd_sm90 import FAMILY
from fa4tune.problem import Problem
from fa4tune.target import get_target

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
H200 = get_target("H200")
# The two shapes the profile is for: head dim 64 over 8 K/V heads, and MQA head dim 128.
GQA = Problem(seqlen_q=1, seqlen_k=131072, batch=1, nheads_q=32, nheads_kv=8, head_dim=64)
MQA = Problem(seqlen_q=1, seqlen_k=131072, batch=1, nheads_q=32, nheads_kv=1, head_dim=128)
# The kernels' names as the profiler lists them (the compiled symbols, cut short).
MAIN = "kernel_cutlass_kernel_fa4tunekernelsfa4_fwd_sm90kernelFlashForwardSm90_object_at__tensor0_0"
COMBINE = "kernel_cutlass_kernel_fa4tunekernelsfa4_fwd_sm90combineSplitCombine_object_at__tens_0"


@pytest.fixture
def report(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # its shared helpers, as a script sees them
    spec = importlib.util.spec_from_file_location("decode_report", BENCHMARKS / "decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_decode_kernels_are_sorted_into_main_combine_and_other(report):
    import kernel_phases

    def phase(name):
        return kernel_phases.phase_of(name, report.PHASES)

    assert phase(MAIN) == "main"
    assert phase(COMBINE) == "combine"
    # torch's kernels and flash-attn-4's are not ours: other.
    for name in (
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>",
        "Memset (Device)",
        "kernel_cutlass_kernel_flash_attnflash_fwd_combineFlashAttentionForwardCombine_0",
        "kernel_cutlass_kernel_flash_attnflash_fwd_sm90FlashAttentionForwardSm90_0",
    ):
        assert phase(name) == "other", name


@pytest.mark.compile
def test_the_compiled_kernels_names_carry_the_phase_pieces(report):
    """The symbols the CuTe DSL gives the split forward kernel (with the combine kernel and with
    the in-kernel merge) and the combine kernel: the names the profiler shows."""
    import re
    from dataclasses import replace

    import kernel_phases

    from fa4tune.kernels.fa4_fwd_sm90.compile import (
        compile_combine,
        compile_forward,
        pack_group_of,
    )

    def kernels(ir_module):
        return set(re.findall(r"kernel_cutlass_kernel_\w+", str(ir_module)))

    default = FAMILY.default_config(GQA, H200)
    assert default.split
    for config in (default, replace(default, combine_in_kernel=True)):
        compiled = compile_forward(
            config, GQA.dtype, GQA.head_dim, GQA.head_dim_v, GQA.causal, H200,
            pack_group=pack_group_of(config, GQA),
        )  # fmt: skip
        (name,) = kernels(compiled.function.ir_module)
        assert kernel_phases.phase_of(name, report.PHASES) == "main", name
    (name,) = kernels(compile_combine(GQA.dtype, GQA.head_dim_v, H200).ir_module)
    assert kernel_phases.phase_of(name, report.PHASES) == "combine", name


def test_the_tuned_and_in_kernel_columns_are_profiled_after_timing(report, monkeypatch):
    """measure: the tuned column and default-ck, where they were timed, get their phases and span
    (profile_call with the decode table); the peers and an untimed column do not."""
    import fa4tune.measure.timing
    import fa4tune.runtime.lookup

    default = FAMILY.default_config(GQA, H200)
    monkeypatch.setattr(
        fa4tune.runtime.lookup,
        "lookup",
        lambda problem, target, kernel: SimpleNamespace(config=default, source="exact"),
    )
    monkeypatch.setattr(report, "random_inputs", lambda problem, seed: (None,) * 3)
    columns = {"tuned": "run tuned", "default": "run default", "flash-attn-4": "run fa4"}
    monkeypatch.setattr(report, "runners_for", lambda *a: dict(columns))
    monkeypatch.setattr(report, "in_kernel_runner", lambda *a: "run ck")
    timed = {"tuned": 0.05, "default": 0.06, "default-ck": 0.055, "flash-attn-4": 0.5}
    failed = set()

    def verify_and_time(problem, runners, q, k, v, rounds):
        return {
            name: "error: X" if name in failed else {"ms": timed[name], "out_error": 1e-3}
            for name in runners
        }

    monkeypatch.setattr(report, "verify_and_time", verify_and_time)
    flushers = []
    monkeypatch.setattr(fa4tune.measure.timing, "L2Flusher", lambda: flushers.append(1) or "flush")
    profiled = []

    def profile_call(fn, flusher, table, calls):
        profiled.append((fn, flusher, table))
        return {"phases_us": {"main": 60.0, "combine": 5.0}, "span_us": 66.0}

    monkeypatch.setattr(report.kernel_phases, "profile_call", profile_call)
    row = report.measure(GQA, H200, FAMILY, rounds=1)
    assert profiled == [("run tuned", "flush", report.PHASES), ("run ck", "flush", report.PHASES)]
    assert flushers == [1]  # one flusher for both
    cells = row["cells"]
    for name in ("tuned", "default-ck"):
        assert cells[name]["phases_us"] == {"main": 60.0, "combine": 5.0}
        assert cells[name]["span_us"] == 66.0
    for name in ("default", "flash-attn-4"):
        assert "phases_us" not in cells[name] and "span_us" not in cells[name]
    # A column that failed its check is not profiled; with none left, no flusher is made.
    failed.update({"tuned", "default-ck"})
    profiled.clear()
    row = report.measure(GQA, H200, FAMILY, rounds=1)
    assert profiled == [] and flushers == [1]
    assert row["cells"]["tuned"] == "error: X"


def cell(ms, phases=None, span=None):
    tbs = 2**28 / (ms * 1e-3) / 1e12
    got = {"ms": ms, "tbs": tbs, "out_error": 2e-3}
    if phases is not None:
        got.update(phases_us=phases, span_us=span)
    return got


def test_the_time_table_renders_main_combine_other_and_span(report, tmp_path, capsys):
    header = {"date": "d", "gpu": "NVIDIA H200", "target": "H200", "torch": "2.11", "dsl": "4.8.1",
              "fa4": "b36", "kernel_hash": "0123456789ab", "rounds": 2}  # fmt: skip
    gqa_bytes, mqa_bytes = GQA.kv_bytes, MQA.kv_bytes
    assert (gqa_bytes, mqa_bytes) == (2**28, 2**26)
    rows = [
        {  # split with the combine kernel; default-ck profiled too (one launch: no combine)
            "key": GQA.key(),
            "kv_bytes": gqa_bytes,
            "tuned_config": "t",
            "tuned_source": "exact",
            "default_config": "d",
            "cells": {
                "tuned": cell(0.082, {"main": 64.0, "combine": 12.0, "other": 1.0}, 80.0),
                "default": cell(0.084),
                "default-ck": cell(0.09, {"main": 88.0}, 88.0),
                "flash-attn-4": cell(0.5),
            },
        },
        {  # a tuned config that does not split, and no default-ck column
            "key": "unsplit",
            "kv_bytes": mqa_bytes,
            "tuned_config": "t",
            "tuned_source": "exact",
            "default_config": "d",
            "cells": {
                "tuned": cell(0.0466, {"main": 40.0}, 40.0),
                "default-ck": "n/a (the default does not split)",
            },
        },
        {  # measured before the profile (or ragged): no phases
            "key": "old",
            "kv_bytes": mqa_bytes,
            "tuned_config": "t",
            "tuned_source": "exact",
            "default_config": "d",
            "cells": {"tuned": cell(0.05), "default-ck": cell(0.06)},
        },
        {  # the tuned column failed its check
            "key": "failed",
            "kv_bytes": mqa_bytes,
            "tuned_config": "t",
            "tuned_source": "exact",
            "default_config": "d",
            "cells": {"tuned": "wrong (O)"},
        },
    ]
    saved = tmp_path / "decode.json"
    saved.write_text(json.dumps({"header": header, "rows": rows}))
    assert report.main(["--render", str(saved)]) == 0
    text = capsys.readouterr().out
    assert "the copy rate is 4.24 TB/s (measured)." in text
    per_shape, times = text.split("## Per shape")[1].split("## Where the decode call's time goes")
    assert per_shape.count(f"| {GQA.key()} | 256 |") == 1  # the per-shape table comes first
    assert "| problem | column | K/V MiB | floor µs | main µs | combine µs | other µs | span µs " \
        "| timed µs | main TB/s |" in times  # fmt: skip
    table = [line for line in times.splitlines() if line.startswith("| ")][1:]
    assert table == [
        # 2**28 bytes: 63.3 µs at 4.24 TB/s; 4.19 TB/s in 64 µs
        f"| {GQA.key()} | tuned | 256 | 63.3 | 64.0 | 12.0 | 1.0 | 80.0 | 82.0 | 4.19 |",
        f"| {GQA.key()} | default-ck | 256 | 63.3 | 88.0 | - | 0.0 | 88.0 | 90.0 | 3.05 |",
        "| unsplit | tuned | 64 | 15.8 | 40.0 | - | 0.0 | 40.0 | 46.6 | 1.68 |",
        "| old | tuned | 64 | 15.8 | - | - | - | - | 50.0 | - |",
        "| old | default-ck | 64 | 15.8 | - | - | - | - | 60.0 | - |",
        "| failed | tuned | 64 | 15.8 | - | - | - | - | - | - |",
    ]

    # No row profiled (a JSON written before the profile): the report as it was, no time table.
    for row in rows[:2]:
        for c in row["cells"].values():
            if isinstance(c, dict):
                c.pop("phases_us", None), c.pop("span_us", None)
    saved.write_text(json.dumps({"header": header, "rows": rows}))
    assert report.main(["--render", str(saved)]) == 0
    assert "time goes" not in capsys.readouterr().out


def test_the_report_says_how_the_l2_flush_left_l2(report):
    """The header's flush mode (run_header: FA4TUNE_L2_FLUSH) in the report's first lines; a JSON
    written before the header had it was timed with the dirty flush."""
    header = {"date": "d", "gpu": "NVIDIA H200", "target": "H200", "torch": "2.11", "dsl": "4.8.1",
              "fa4": "4.0", "kernel_hash": "0" * 12, "rounds": 2}  # fmt: skip
    assert "overwrote a buffer twice its size (dirty lines" in report.render([], header)
    header["flush"] = "clean"
    text = report.render([], header)
    assert "read a buffer twice its size (clean lines" in text and "overwrote" not in text


def test_the_copy_rate_is_the_measured_gpus(report):
    """The floor and the 85% target come from the H200's measured copy rate on the H200, and from
    the target's HBM rate (named as such) on a GPU whose copy rate was not measured."""
    from fa4tune.target import get_target

    header = {"date": "d", "gpu": "NVIDIA H200", "target": "H200", "torch": "2.11", "dsl": "4.8.1",
              "fa4": "4.0", "kernel_hash": "0" * 12, "rounds": 2, "flush": "clean"}  # fmt: skip
    assert report.copy_rate(header) == (4.24, "measured")
    assert "(target ≥ 3.60: 85% of the copy rate)" in report.render([], header)
    header.update(gpu="NVIDIA H100 80GB HBM3", target="H100-SXM")
    rate = get_target("H100-SXM").hbm_bytes_per_s / 1e12
    assert report.copy_rate(header) == (rate, "the H100-SXM target's HBM rate")
    text = report.render([], header)
    assert f"the copy rate is {rate:.2f} TB/s (the H100-SXM target's HBM rate)" in text
    assert f"(target ≥ {0.85 * rate:.2f}: 85% of the copy rate)" in text
