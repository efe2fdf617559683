"""A CUDA device is mapped to its target with its own SM count: a persistent kernel sizes its grid
by it, so an H100 PCIe (114 SMs) or a MIG slice must not be compiled for 132."""

import warnings
from types import SimpleNamespace

import pytest

from fa4tune.kernels import get_kernel
from fa4tune.kernels.fa4_fwd_sm90.compile import compile_key
from fa4tune.target import TARGETS, get_target, target_for_device_name


@pytest.mark.parametrize(
    "name, sms, expected, expected_sms",
    [
        ("NVIDIA H200", 132, "H200", 132),
        ("NVIDIA H100 80GB HBM3", 132, "H100-SXM", 132),
        ("NVIDIA H100 PCIe", 114, "H100-PCIe", 114),
        ("NVIDIA H800 PCIe", 114, "H100-PCIe", 114),
        ("NVIDIA H100 NVL", 132, "H100-SXM", 132),
        (
            "NVIDIA H100 80GB HBM3 MIG 3g.40gb",
            60,
            "H100-SXM",
            60,
        ),  # a MIG slice: the model's target, its SMs
        ("NVIDIA H200", None, "H200", 132),  # no count given: the model's
        ("NVIDIA A100-SXM4-80GB", 108, None, None),
    ],
)
def test_a_device_gets_its_models_target_with_its_own_sm_count(name, sms, expected, expected_sms):
    target = target_for_device_name(name, sms)
    if expected is None:
        assert target is None
        return
    assert (target.name, target.sm_count) == (expected, expected_sms)
    assert target.arch == TARGETS[expected].arch and target.l2_bytes == TARGETS[expected].l2_bytes


def test_kernels_for_other_sm_counts_are_compiled_apart():
    config = get_kernel().config({})
    h200, slice_ = get_target("H200"), target_for_device_name("NVIDIA H200", 66)
    assert compile_key(config, "bf16", 128, 128, True, h200) != compile_key(
        config, "bf16", 128, 128, True, slice_
    )


def test_dispatch_runs_a_hopper_gpu_it_has_no_description_of_on_default_configs(monkeypatch):
    torch = pytest.importorskip("torch")
    from fa4tune.runtime import dispatch
    from fa4tune.runtime.dispatch import UnsupportedInput, device_target

    def props(name, major, minor, sms):
        return lambda device: SimpleNamespace(
            name=name, major=major, minor=minor, multi_processor_count=sms
        )

    monkeypatch.setattr(torch.cuda, "get_device_properties", props("NVIDIA H20", 9, 0, 78))
    monkeypatch.setattr(dispatch, "_UNDESCRIBED_SEEN", set())
    h20, _ = device_target("cuda:0")
    assert (h20.name, h20.arch, h20.sm_count, h20.smem_per_block) == (
        "NVIDIA H20",
        "sm_90a",
        78,
        227 * 1024,
    )
    with pytest.warns(
        RuntimeWarning, match="NVIDIA H20 is a Hopper GPU .* default configs, sized to its 78 SMs"
    ):
        dispatch._say_undescribed(h20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per model, and never for a GPU fa4tune describes
        dispatch._say_undescribed(device_target("cuda:1")[0])
        dispatch._say_undescribed(get_target("H200"))
        dispatch._say_undescribed(target_for_device_name("NVIDIA H200", 66))
    # fa4tune.lookup with no target asks the same question and gets the same answer.
    import fa4tune
    from fa4tune import runtime
    from fa4tune.problem import Problem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    runtime.reset()
    try:
        problem = Problem(
            head_dim=128, seqlen_q=8192, batch=2, nheads_q=32, nheads_kv=8, causal=True
        )
        assert fa4tune.lookup(problem).source == "default"
        # The cost model and searches take a described GPU only: get_target(None) falls back to
        # H200.
        assert get_target(None).name == "H200"
        assert (
            dispatch.explain(
                torch.empty(2, 8192, 32, 128, device="meta", dtype=torch.bfloat16),
                *(torch.empty(2, 8192, 8, 128, device="meta", dtype=torch.bfloat16),) * 2,
                causal=True,
            ).source
            == "default"
        )
    finally:
        runtime.reset()
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", props("NVIDIA A100-SXM4-80GB", 8, 0, 108)
    )
    with pytest.raises(
        UnsupportedInput, match=r"runs on Hopper GPUs .* \(compute capability 8.0\)"
    ):
        device_target("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_properties", props("NVIDIA H100 PCIe", 9, 0, 114))
    target, family = device_target("cuda:0")
    assert (target.name, target.sm_count, family.name) == ("H100-PCIe", 114, "fa4_fwd_sm90")


def test_a_broken_family_plugin_does_not_stop_attention_on_the_gpus_it_does_not_serve(
    monkeypatch, broken_family_plugin
):
    torch = pytest.importorskip("torch")
    from fa4tune.runtime import dispatch
    from fa4tune.runtime.dispatch import UnsupportedInput, device_target

    def props(name, major, sms):
        return lambda device: SimpleNamespace(
            name=name, major=major, minor=0, multi_processor_count=sms
        )

    monkeypatch.setattr(dispatch, "_BROKEN_PLUGINS", set())  # warned once per process
    monkeypatch.setattr(torch.cuda, "get_device_properties", props("NVIDIA H200", 9, 132))
    with pytest.warns(RuntimeWarning, match="'broken' = 'brokenfamily_mod:FAMILY'.*needs a"):
        target, family = device_target("cuda:0")
    assert (target.name, family.name) == ("H200", "fa4_fwd_sm90")
    # A GPU no loaded family serves: the refusal names the plugin that might have.
    monkeypatch.setattr(torch.cuda, "get_device_properties", props("NVIDIA B200", 10, 148))
    with pytest.raises(UnsupportedInput, match=r"B200 .*\(cannot load kernel family .*'broken'"):
        device_target("cuda:0")


def test_an_undescribed_hopper_gets_default_configs_sized_to_its_sms_and_l2():
    import fa4tune
    from fa4tune.kernels.fa4_fwd_sm90.launch import heads_per_l2_group
    from fa4tune.problem import Problem
    from fa4tune.target import undescribed_hopper

    h20 = undescribed_hopper("NVIDIA H20", 78, 60 * 2**20)
    problem = Problem(head_dim=128, seqlen_q=8192, batch=2, nheads_q=32, nheads_kv=8, causal=True)
    # The shipped H200 table has this very problem; a GPU it does not describe borrows nothing from
    # it.
    assert fa4tune.lookup(problem, "H200").source == "exact"
    result = fa4tune.lookup(problem, h20)
    assert result.source == "default" and result.config == get_kernel().default_config(problem, h20)
    # K/V of 1 MB per head: 16 heads side by side in half of a 60 MB L2, 8 in half of 20 MB.
    assert heads_per_l2_group(problem, h20) == 16
    assert heads_per_l2_group(problem, undescribed_hopper("x", 78, 20 * 2**20)) == 8
    assert (
        undescribed_hopper("x", 78).l2_bytes == get_target("H100-SXM").l2_bytes
    )  # torch did not say
    assert (
        h20.l2_bytes == 60 * 2**20
        and h20.tensor_flops_per_clk == get_target("H100-SXM").tensor_flops_per_clk
    )


def test_the_gpu_worker_compiles_for_the_whole_target_it_is_sent():
    """The search sends the worker its target whole: a MIG slice's SM count must reach the
    compile."""
    from fa4tune.measure.gpu_worker import _candidate
    from fa4tune.problem import Problem

    slice_ = target_for_device_name("NVIDIA H200", 66)
    request = {
        "problem": Problem(head_dim=64).to_dict(),
        "config": get_kernel().config({}).to_dict(),
        "target": slice_.to_dict(),
    }
    assert _candidate(request)[3] == slice_
    assert _candidate({**request, "target": "H200"})[3] == get_target("H200")  # a name, as before


def test_a_search_refuses_a_gpu_with_other_sms_than_its_model():
    """Timings are stored and exported under the target's name: a MIG slice's would pass for the
    whole H200's."""
    from fa4tune.errors import BackendError
    from fa4tune.measure.gpu import _worker_target

    assert (
        _worker_target({"target": "H200", "sm_count": 132, "gpu_name": "NVIDIA H200"}, None).name
        == "H200"
    )
    with pytest.raises(BackendError, match="has 66 SMs, not the 132 of an H200 .*whole GPU"):
        _worker_target(
            {"target": "H200", "sm_count": 66, "gpu_name": "NVIDIA H200 MIG 3g.71gb"}, None
        )


def test_a_multi_worker_search_refuses_gpus_with_other_sms_than_their_model(monkeypatch):
    torch = pytest.importorskip("torch")
    from fa4tune.errors import BackendError
    from fa4tune.tune import workers

    monkeypatch.setattr(workers, "visible_gpus", lambda: ["0", "1"])

    def props(sms):
        return lambda index: SimpleNamespace(name="NVIDIA H200", multi_processor_count=sms)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props(132))
    assert workers.gpu_target(["0", "1"], None).name == "H200"
    monkeypatch.setattr(torch.cuda, "get_device_properties", props(66))
    with pytest.raises(
        BackendError, match="each of the workers. GPUs .* has 66 SMs, not the 132 of an H200"
    ):
        workers.gpu_target(["0", "1"], None)


@pytest.mark.parametrize(
    "name, major, known, healthy",
    [
        ("NVIDIA H20", 9, "target UNKNOWN: fa4tune.attention runs the default configs", True),
        ("NVIDIA A100-SXM4-80GB", 8, "target UNKNOWN (no tuned tables)", False),
        ("NVIDIA H100 PCIe", 9, "target H100-PCIe", True),
    ],
)
def test_doctor_says_what_runs_on_the_gpu(monkeypatch, workdir, name, major, known, healthy):
    torch = pytest.importorskip("torch")
    from fa4tune.doctor import diagnose

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(
        torch.cuda,
        "get_device_properties",
        lambda device: SimpleNamespace(name=name, major=major, minor=0, multi_processor_count=114),
    )
    [gpu] = [line for line in diagnose(str(workdir / "r.db")) if line[0] == "gpu"]
    assert gpu[1] == healthy and gpu[2].startswith(f"{name}, 114 SMs, sm_{major}0; {known}")
