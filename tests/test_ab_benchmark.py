"""benchmarks/ab.py without a GPU: what --set takes, which columns a shape gets (refused, already
the base, the variant), and clean refusals (exit 2, the reason named) for bad arguments or no
GPU."""

import importlib.util
import sys
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
        (["--set", "q_stages=2", "--table-target", "H200"], "add --table"),
        (["--set", "q_stages=2", "--table", "t.yaml", "--table-target", "B300"], "unknown target"),
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


def test_backward_knobs_get_the_backward_families_columns():
    from fa4tune.kernels.fa4_bwd_sm90.config import BwdConfig

    assert ab.parse_changes(["dq_warp=true"], "fa4_bwd_sm90") == {"dq_warp": True}
    with pytest.raises(ValueError, match="--kernel: unknown kernel 'fa4_nope'"):
        ab.parse_changes(["dq_warp=true"], "fa4_nope")
    with pytest.raises(ValueError, match="a knob of tile_m"):
        ab.parse_changes(["q_stages=2"], "fa4_bwd_sm90")  # the forward's knob
    default = BwdConfig(dq_tma=True, ds_stages=2, dq_warp=True)
    columns = ab.columns_for(HDIM128, default, BwdConfig(), {"dq_warp": True}, H200, "fa4_bwd_sm90")
    assert columns["default+"] == "= default (it has the change)"
    assert columns["tuned+"].startswith("refused: dq_warp without dq_tma")
    columns = ab.columns_for(HDIM128, default, default, {"tile_m": 128}, H200, "fa4_bwd_sm90")
    assert "consumer threads need" in columns["default+"]  # 128 rows fit at hd64 only


class FakeFamily:
    """A family whose 'kernel' copies its input (column 'good'), writes nothing ('lazy') or
    raises ('broken'); measured on the CPU."""

    def __init__(self):
        import torch

        self.torch, self.seeds, self.references = torch, [], 0

    def measurement_case(self, problem, device):
        return {"x": self.torch.empty(4), "out": self.torch.empty(4)}

    def randomize(self, case, seed):
        self.seeds.append(seed)
        case["x"].copy_(self.torch.arange(4.0) + seed)

    def launcher(self, case, config, target):
        def run():
            if config == ("broken",):
                raise RuntimeError("no kernel\nsecond line")
            if config != ("lazy",):
                case["out"].copy_(case["x"])

        return run

    def reference(self, case):
        self.references += 1
        return case["x"].clone()

    def poison(self, case):
        case["out"].fill_(float("nan"))

    def compare(self, case, reference):
        from fa4tune.kernels.family import Check

        bad = bool(self.torch.isnan(case["out"]).any())
        return Check(out_error=0.0, lse_error=0.0, problem="NaN left" if bad else None)

    def tolerance(self, problem):
        from fa4tune.kernels.family import Tolerance

        return Tolerance(out=1e-2, lse=1e-2)

    def work_flops(self, problem):
        return 123.0


def test_each_column_is_checked_on_its_own_case_before_it_is_timed(monkeypatch):
    import torch

    timed = {}

    def time_interleaved(problem, runners, rounds, flops=None):
        timed.update(runners=sorted(runners), rounds=rounds, flops=flops)
        return {name: {"ms": 1.0, "tflops": 1.0, "round_spread": 0.0} for name in runners}

    shared = sys.modules[ab.check_then_time.__module__]  # where the measuring helpers live
    monkeypatch.setattr(shared, "time_interleaved", time_interleaved)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    family = FakeFamily()
    columns = {
        "default": ("good",),  # configs: anything but a string (a string is the reason)
        "default+": ("lazy",),
        "tuned": ("broken",),
        "tuned+": "refused: shared memory",
    }
    cells = ab.measure(HDIM128, columns, family, H200, rounds=2)
    assert cells["default"]["out_error"] == 0.0
    assert cells["default+"] == "wrong (NaN left)"  # poisoned first: the unwritten output shows
    assert cells["tuned"] == "error: RuntimeError: no kernel"
    assert cells["tuned+"] == "refused: shared memory"
    assert timed == {"runners": ["default"], "rounds": 2, "flops": 123.0}
    # Every column its own case with the same inputs (one seed); one reference.
    assert len(family.seeds) == 3 and len(set(family.seeds)) == 1 and family.references == 1


@pytest.mark.compile
@pytest.mark.parametrize("kernel", ["fa4_fwd_sm90", "fa4_bwd_sm90"])
def test_compile_all_builds_and_loads_each_family_for_sm90a(kernel, tmp_path, monkeypatch):
    from fa4tune.kernels import get_kernel

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # the spawned compile processes inherit it
    family = get_kernel(kernel)
    problem = Problem(head_dim=64, seqlen_q=1024, batch=2, nheads_q=4)
    config = family.default_config(problem, H200)
    assert ab.compile_all([(problem, config)], family, H200, tmp_path, 1) == {}
    assert list(tmp_path.glob("*.o"))


def test_a_jobs_problems_can_be_taken_and_filtered():
    job = str(REPO / "tuning_configs" / "h200-bf16-decode.yaml")
    problems = ab.job_problems(job, ["d64x64-full-q1-k131072"], "fa4_fwd_sm90")
    assert [p.key() for p in problems] == ["bf16-d64x64-full-q1-k131072-b1-h32x8"]
    assert len(ab.job_problems(job, ["k131072", "k4096-b64"], "fa4_fwd_sm90")) == 8
    with pytest.raises(ValueError, match="none of the job's 17 problems"):
        ab.job_problems(job, ["k999"], "fa4_fwd_sm90")
    train = str(REPO / "tuning_configs" / "h200-bf16-train.yaml")
    with pytest.raises(ValueError, match="tunes fa4_bwd_sm90, not --kernel fa4_fwd_sm90"):
        ab.job_problems(train, [], "fa4_fwd_sm90")
    with pytest.raises(ValueError, match="--job nope.yaml"):
        ab.job_problems("nope.yaml", [], "fa4_fwd_sm90")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--shapes", "64:1024", "--job", "x.yaml"], "not both"),
        (["--match", "k4096"], "give --job"),
        (["--job", "nope.yaml"], "--job nope.yaml"),
    ],
)
def test_job_arguments_are_checked(argv, message, capsys):
    assert ab.main(["--set", "num_splits=4", *argv]) == 2
    assert message in capsys.readouterr().err


def test_a_decode_problems_columns_take_the_change(monkeypatch, capsys):
    import torch

    job = str(REPO / "tuning_configs" / "h200-bf16-decode.yaml")
    problem = ab.job_problems(job, ["d64x64-full-q1-k131072"], "fa4_fwd_sm90")[0]
    from fa4tune.kernels import get_kernel
    from fa4tune.target import get_target

    kernel, target = get_kernel("fa4_fwd_sm90"), get_target("H200")
    default = kernel.default_config(problem, target)
    columns = ab.columns_for(problem, default, default, {"num_splits": 4}, target)
    assert columns["default+"].num_splits == 4 and default.num_splits != 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ab.main(["--set", "num_splits=4", "--job", job, "--match", "k131072-b1-h32x8"]) == 2
    assert "needs an NVIDIA GPU" in capsys.readouterr().err


def test_a_table_of_another_gpu_is_looked_up_for_it_or_said_to_serve_nothing(capsys):
    """The H200's train table on an H100: looked up for the H100 it serves no shape, and stderr
    says so (`tuned` is the default, which session 61's A/B took for the table's config); with
    --table-target H200 `tuned` is the H200's entry, and the lookup column names whose."""
    from fa4tune.kernels import get_kernel
    from fa4tune.problem import Problem
    from fa4tune.target import get_target

    table = str(REPO / "tuning_configs" / "tables" / "h200-bf16-train.yaml")
    problem = Problem(dtype="bf16", head_dim=64, seqlen_q=1024, batch=16, nheads_q=32, causal=True)
    kernel, h100, h200 = get_kernel("fa4_bwd_sm90"), get_target("H100-SXM"), get_target("H200")
    found, how = ab.tuned_lookup(problem, kernel.name, h100, table)
    assert how.startswith("default") and found.config == kernel.default_config(problem, h100)
    assert "has no H100-SXM entry" in capsys.readouterr().err
    found, how = ab.tuned_lookup(problem, kernel.name, h100, table, h200)
    assert how.startswith("exact, H200's") and found.config.persistent
    assert capsys.readouterr().err == ""
