"""benchmarks/ab.py without a GPU: what --set takes, which columns a shape gets (refused, already
the base, the variant), and clean refusals (exit 2, the reason named) for bad arguments or no
GPU."""

import importlib.util
from pathlib import Path

import pytest

from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
from fa4tune.problem import Problem
from fa4tune.target import get_target

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("ab", REPO / "benchmarks" / "ab.py")
ab = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab)

H200 = get_target("H200")
HDIM128 = Problem(head_dim=128, seqlen_q=1024, batch=16, nheads_q=16)


def test_set_values_are_typed_as_the_schema_types_them():
    assert ab.parse_changes(["q_stages=2.0", "wg_epilogue=true", "rescale_threshold=4"]) == {
        "q_stages": 2,
        "wg_epilogue": True,
        "rescale_threshold": 4.0,
    }
    assert type(ab.parse_changes(["q_stages=2.0"])["q_stages"]) is int


@pytest.mark.parametrize(
    "item,match",
    [
        ("q_stages=abc", "'abc' is neither a number nor true/false"),
        ("q_stages=3", r"q_stages=3 \(legal: 1, 2\)"),
        ("tile=128", "a knob of tile_m"),
        ("q_stages", "knob=value"),
    ],
)
def test_bad_set_items_are_named(item, match):
    with pytest.raises(ValueError, match=match):
        ab.parse_changes([item])


def test_columns_say_why_a_variant_is_not_run():
    default = FwdConfig(rescale_threshold=8.0, persistent=True)
    wide = FwdConfig(tile_n=160, rescale_threshold=8.0, persistent=True)
    columns = ab.columns_for(HDIM128, default, wide, {"q_stages": 2}, H200)
    assert columns["default"] is default and columns["default+"] == FwdConfig(
        rescale_threshold=8.0, persistent=True, q_stages=2
    )
    assert columns["tuned+"].startswith(
        "refused: shared memory"
    )  # a second Q does not fit beside 160-wide K/V
    # A base that already has the change gets no second, identical column (it would dilute the
    # mean).
    columns = ab.columns_for(
        HDIM128, default, FwdConfig(persistent=True, q_stages=2), {"q_stages": 2}, H200
    )
    assert columns["tuned+"] == "= tuned (it has the change)"
    # A change that only moves a knob without effect (poly_degree without emulation) is the base
    # too.
    assert ab.columns_for(HDIM128, default, default, {"poly_degree": 5}, H200)[
        "default+"
    ].startswith("= default")


def test_gain_is_base_time_over_variant_time():
    cells = {
        "tuned": {"ms": 2.0},
        "tuned+": {"ms": 1.0},
        "default": {"ms": 1.0},
        "default+": "refused: x",
    }
    assert ab.gain(cells, "tuned") == 2.0 and ab.gain(cells, "default") is None


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--set", "q_stages=abc"], "neither a number"),
        (["--set", "q_stages=2", "--shapes", "100:1024"], "'100:1024': unsupported head_dim 100"),
        (["--set", "q_stages=2", "--shapes", "64"], "'64': want head_dim:seqlen"),
        (["--set", "q_stages=2", "--shapes", ","], "names no shape"),
        ([], "give at least one --set"),
        (["--set", "q_stages=2", "--rounds", "0"], "must be at least 1"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(argv, message, capsys):
    assert ab.main(argv) == 2
    assert message in capsys.readouterr().err


def test_without_a_gpu_it_says_so(capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ab.main(["--set", "q_stages=2", "--shapes", "128:1024"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err
