"""A CUDA device is mapped to its target with its own SM count: a persistent kernel sizes its grid by
it, so an H100 PCIe (114 SMs) or a MIG slice must not be compiled for 132."""

from types import SimpleNamespace

import pytest

from fa4tune.kernels import get_kernel
from fa4tune.kernels.interface import compile_key
from fa4tune.target import TARGETS, get_target, target_for_device_name


@pytest.mark.parametrize("name, sms, expected, expected_sms", [
    ("NVIDIA H200", 132, "H200", 132),
    ("NVIDIA H100 80GB HBM3", 132, "H100-SXM", 132),
    ("NVIDIA H100 PCIe", 114, "H100-PCIe", 114),
    ("NVIDIA H800 PCIe", 114, "H100-PCIe", 114),
    ("NVIDIA H100 NVL", 132, "H100-SXM", 132),
    ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 60, "H100-SXM", 60),  # a MIG slice: the model's target, its SMs
    ("NVIDIA H200", None, "H200", 132),  # no count given: the model's
    ("NVIDIA A100-SXM4-80GB", 108, None, None),
])
def test_a_device_gets_its_models_target_with_its_own_sm_count(name, sms, expected, expected_sms):
    target = target_for_device_name(name, sms)
    if expected is None:
        assert target is None
        return
    assert (target.name, target.sm_count) == (expected, expected_sms)
    assert target.arch == TARGETS[expected].arch and target.l2_bytes == TARGETS[expected].l2_bytes


def test_kernels_for_other_sm_counts_are_compiled_apart():
    config = get_kernel().make_config({})
    h200, slice_ = get_target("H200"), target_for_device_name("NVIDIA H200", 66)
    assert compile_key(config, "bf16", 128, 128, True, h200) != compile_key(config, "bf16", 128, 128, True, slice_)


def test_dispatch_names_a_hopper_gpu_it_has_no_description_of(monkeypatch):
    torch = pytest.importorskip("torch")
    from fa4tune.dispatch import UnsupportedInput, _device_target

    def props(name, major, minor, sms):
        return lambda device: SimpleNamespace(name=name, major=major, minor=minor, multi_processor_count=sms)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props("NVIDIA H20", 9, 0, 78))
    with pytest.raises(UnsupportedInput, match="no description of NVIDIA H20 .* knows H100 and H200"):
        _device_target("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_properties", props("NVIDIA A100-SXM4-80GB", 8, 0, 108))
    with pytest.raises(UnsupportedInput, match=r"runs on Hopper GPUs .* \(compute capability 8.0\)"):
        _device_target("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_properties", props("NVIDIA H100 PCIe", 9, 0, 114))
    assert (_device_target("cuda:0").name, _device_target("cuda:0").sm_count) == ("H100-PCIe", 114)


def test_the_gpu_worker_compiles_for_the_whole_target_it_is_sent():
    """The search sends the worker its target whole: a MIG slice's SM count must reach the compile."""
    from fa4tune.measure.gpu_worker import _candidate
    from fa4tune.problem import Problem

    slice_ = target_for_device_name("NVIDIA H200", 66)
    request = {"problem": Problem(head_dim=64).to_dict(), "config": get_kernel().make_config({}).to_dict(),
               "target": slice_.to_dict()}
    assert _candidate(request)[2] == slice_
    assert _candidate({**request, "target": "H200"})[2] == get_target("H200")  # a name, as before


def test_a_search_refuses_a_gpu_with_other_sms_than_its_model():
    """Timings are stored and exported under the target's name: a MIG slice's would pass for the
    whole H200's."""
    from fa4tune.errors import BackendError
    from fa4tune.measure.gpu import _worker_target

    assert _worker_target({"target": "H200", "sm_count": 132, "gpu_name": "NVIDIA H200"}, None).name == "H200"
    with pytest.raises(BackendError, match="has 66 SMs, not the 132 of an H200 .*whole GPU"):
        _worker_target({"target": "H200", "sm_count": 66, "gpu_name": "NVIDIA H200 MIG 3g.71gb"}, None)


def test_a_multi_worker_search_refuses_gpus_with_other_sms_than_their_model(monkeypatch):
    torch = pytest.importorskip("torch")
    from fa4tune import workers
    from fa4tune.errors import BackendError

    monkeypatch.setattr(workers, "visible_gpus", lambda: ["0", "1"])

    def props(sms):
        return lambda index: SimpleNamespace(name="NVIDIA H200", multi_processor_count=sms)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props(132))
    assert workers.gpu_target(["0", "1"], None).name == "H200"
    monkeypatch.setattr(torch.cuda, "get_device_properties", props(66))
    with pytest.raises(BackendError, match="each of the workers. GPUs .* has 66 SMs, not the 132 of an H200"):
        workers.gpu_target(["0", "1"], None)
