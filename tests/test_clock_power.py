"""benchmarks/clock_power.py without a GPU: nvidia-smi's samples read (unreadable lines left out),
the reason bits named, a window summarised, the table (medians over repetitions, cycles, the
fa4tune / flash-attn-4 ratios), and clean refusals of bad arguments and of a machine without a
GPU."""

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("clock_power", REPO / "benchmarks" / "clock_power.py")
cp = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cp)

SMI = """2026/12/07 00:00:00.000, 1980, 312.50, 41, 0x0000000000000000
2026/12/07 00:00:00.050, 1755, 698.10, 63, 0x0000000000000004
2026/12/07 00:00:00.100, [N/A], 650.00, 63, 0x0000000000000004
2026/12/07 00:00:00.150, 1710, 700.00, 64, 0x0000000000000024
2026/12/07 00:00:00.200, 17"""


def test_samples_are_read_and_unreadable_lines_left_out():
    samples = cp.parse_samples(SMI)
    assert [s.mhz for s in samples] == [1980.0, 1755.0, 1710.0]
    assert samples[1] == cp.Sample(1755.0, 698.1, 63.0, 0x4)
    assert cp.parse_samples("") == []


def test_reason_bits_are_named_and_unknown_ones_kept():
    assert cp.reason_names(0) == []
    assert cp.reason_names(0x24) == ["sw power cap", "sw thermal"]
    assert cp.reason_names(0x1000 | 0x8) == ["hw slowdown", "0x1000"]


def test_a_window_is_its_mean_clock_and_power_and_every_reason_seen():
    got = cp.summarise(cp.parse_samples(SMI)[1:])
    assert got["mhz"] == pytest.approx((1755 + 1710) / 2)
    assert got["mhz_min"] == 1710.0
    assert got["watts"] == pytest.approx(699.05)
    assert got["celsius"] == 64.0
    assert got["reasons"] == ["sw power cap", "sw thermal"]
    assert got["samples"] == 2
    with pytest.raises(ValueError, match="no clock samples"):
        cp.summarise([])


def row(side, rep, us, mhz, window=2500.0, shape="128:16384:causal", reasons=("sw power cap",)):
    return {
        "shape": shape, "side": side, "rep": rep, "window_ms": window, "us": us, "mhz": mhz,
        "mhz_min": mhz - 20, "watts": 690.0, "celsius": 60.0 + rep, "reasons": list(reasons),
    }  # fmt: skip


def test_the_table_takes_medians_over_repetitions_and_compares_time_and_cycles():
    rows = [
        row("fa4tune", 0, 4200.0, 1700.0),
        row("fa4tune", 1, 4000.0, 1700.0),
        row("fa4tune", 2, 4100.0, 1750.0),
        row("flash-attn-4", 0, 3900.0, 1800.0),
        row("flash-attn-4", 1, 3900.0, 1800.0, reasons=()),
        row("fa4tune", 0, 4000.0, 1900.0, window=400.0, reasons=()),
    ]
    text = cp.render(rows)
    lines = text.splitlines()
    ours = next(x for x in lines if "| 2500 | fa4tune |" in x)
    # median 4100 us at median 1700 MHz: 6.97 M cycles; lowest clock 1680; hottest 62
    assert "| 4100 | 1700 (1680) | 690 | 6.97 | 62 | sw power cap |" in ours
    peer = next(x for x in lines if "| 2500 | flash-attn-4 |" in x)
    assert "| 3900 | 1800 (1780) | 690 | 7.02 | 61 | sw power cap |" in peer
    short = next(x for x in lines if "| 400 | fa4tune |" in x)
    assert short.endswith("| none |")
    # the ratios: only where both sides ran the window
    assert "| 128:16384:causal | 2500 | 1.051 | 0.993 |" in lines
    assert not any(x.startswith("| 128:16384:causal | 400 | ") and x.count("|") == 5 for x in lines)


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["--shapes", "128:4096:sideways"], "want causal or gN"),
        (["--windows", "0"], "windows above 0 ms"),
        (["--reps", "0"], "--reps 1 or more"),
        (["--windows", "x"], "could not convert"),
    ],
)
def test_bad_arguments_are_refused_with_the_reason(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        cp.main(argv)
    assert exit_.value.code == 2
    assert fragment in capsys.readouterr().err


def test_without_a_gpu_it_says_so(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cp.main(["--shapes", "64:1024"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_without_flash_attn_4_it_says_so(monkeypatch, capsys):
    monkeypatch.setattr(cp, "gpu_target", lambda prog: object())
    monkeypatch.setattr(cp.importlib.util, "find_spec", lambda name: None)
    assert cp.main(["--shapes", "64:1024"]) == 2
    assert "flash-attn-4, which is not installed" in capsys.readouterr().err
