"""Compile the forward kernel for sm_90a on the CPU (no GPU needed) and check ptxas's report: every
default config and a spread of others must build and must not spill registers to local memory."""

from __future__ import annotations

import os
import re

import pytest

pytestmark = pytest.mark.compile

from fa4tune.kernels.config import ConfigError, FwdConfig, default_config, infeasible_reasons  # noqa: E402
from fa4tune.problem import Problem  # noqa: E402
from fa4tune.target import get_target  # noqa: E402

# (config or None for the default, dtype, head_dim, head_dim_v, causal)
SPREAD = [
    (None, "bf16", 64, 64, False),
    (None, "bf16", 64, 64, True),
    (None, "bf16", 128, 128, False),
    (None, "bf16", 128, 128, True),
    (None, "fp16", 96, 96, True),
    (None, "bf16", 192, 128, False),
    (None, "bf16", 256, 256, True),
    (FwdConfig(tile_n=176), "bf16", 128, 128, False),
    (FwdConfig(intra_wg_overlap=False, wg_pingpong=False, num_stages=3), "bf16", 128, 128, True),
    (FwdConfig(tile_m=192, tile_n=96, num_stages=5, emu_share=0.5, poly_degree=5), "bf16", 64, 64, True),
    (FwdConfig(tile_n=112, emu_share=0.375, poly_degree=4, rescale_threshold=4.0), "fp16", 192, 192, False),
    (FwdConfig(rescale_threshold=8.0, persistent=True), "bf16", 128, 128, False),
    (FwdConfig(tile_m=192, rescale_branch=False, persistent=True), "bf16", 64, 64, True),
    (FwdConfig(intra_wg_overlap=False, rescale_branch=False, persistent=True), "fp16", 128, 128, True),
]


def _ptxas_report(text: str) -> list[tuple[int, int, int]]:
    """(stack frame, spill stores, spill loads) bytes of every function ptxas reported."""
    return [tuple(int(v) for v in m) for m in re.findall(
        r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)]


@pytest.mark.parametrize("config,dtype,head_dim,head_dim_v,causal", SPREAD,
                         ids=lambda v: v.short() if isinstance(v, FwdConfig) else str(v))
def test_compiles_for_sm90a_without_spills(config, dtype, head_dim, head_dim_v, causal, capfd):
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from fa4tune.kernels.interface import compile_forward

    problem = Problem(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal)
    config = config or default_config(problem)
    # Bypass the cache: the remarks are only printed by a real compile.
    compiled = compile_forward(config, dtype, head_dim, head_dim_v, causal, "H200", options="remarks{ptx}",
                               use_cache=False)
    report = _ptxas_report("".join(capfd.readouterr()))
    assert report, "ptxas printed no resource report: the spill check would be blind"
    for stack, stores, loads in report:
        assert (stack, stores, loads) == (0, 0, 0), f"{config.short()} spills: {report}"
    assert compiled.compile_seconds > 0


def test_infeasible_config_is_refused_before_compiling():
    from fa4tune.kernels.interface import compile_forward

    with pytest.raises(ConfigError, match="shared memory"):
        compile_forward(FwdConfig(tile_n=192, num_stages=5), "bf16", 128, 128, False, "H200")
    with pytest.raises(ConfigError, match="poly_degree 1|degree 1"):
        compile_forward(FwdConfig(emu_share=0.25, poly_degree=1), "bf16", 128, 128, False, "H200")
    # Persistent CTAs give O its own buffer: 3 stages of hdim 128 fit without it, not with it.
    assert not infeasible_reasons(Problem(dtype="bf16", head_dim=128), FwdConfig(num_stages=3), get_target("H200"))
    with pytest.raises(ConfigError, match="persistent.*o 32 KB"):
        compile_forward(FwdConfig(num_stages=3, persistent=True), "bf16", 128, 128, False, "H200")



@pytest.mark.parametrize("persistent,causal", [(True, True), (True, False), (False, True)])
def test_shared_storage_is_what_the_resource_model_books(persistent, causal, monkeypatch):
    """The search rejects configs by resources.smem_bytes; a kernel whose shared storage is larger
    would pass that check and fail to launch at the limit. (Before the tile-number slot moved into
    the barrier region, a persistent causal kernel took 1 KB more than the model said.)"""
    import cutlass.utils

    from fa4tune.kernels import resources
    from fa4tune.kernels.interface import compile_forward

    sizes = []
    allocate = cutlass.utils.SmemAllocator.allocate

    def recording_allocate(self, struct, *args, **kwargs):
        sizes.append(struct.size_in_bytes())
        return allocate(self, struct, *args, **kwargs)

    monkeypatch.setattr(cutlass.utils.SmemAllocator, "allocate", recording_allocate)
    config = FwdConfig(persistent=persistent)
    compile_forward(config, "bf16", 128, 128, causal, "H200", use_cache=False)
    assert sizes, "the kernel no longer allocates its shared storage through SmemAllocator"
    assert sizes[-1] == resources.smem_bytes(config, Problem(dtype="bf16", head_dim=128, causal=causal))
