"""fa4_fwd_sm90: the dense forward kernel for Hopper (prefill and decode), as a kernel family.

    config.py      the knobs (FwdConfig), their legal values, the feasibility rules, the defaults
    resources.py   shared-memory, register and tiling model (the rules' numbers)
    kernel.py      the CuTe DSL kernel (FlashForwardSm90)
    arguments.py   the argument groups its device methods pass each other
    compile.py     compiling, the compile cache, object files
    launch.py      attention_forward and the prepared launch of fa4tune.attention
    cost_model.py  the analytic model the `model` backend times candidates with; calibrate.py
                   fits it
    peers.py       flash-attn-4 and cuDNN, for the benchmarks

The shared Hopper device code is in ../sm90/, the host-side pieces shared by attention families in
../common/."""

from __future__ import annotations

from dataclasses import replace

from ...problem import Problem
from ...target import get_target
from ..common import measure as attention_measure
from ..family import KernelFamily
from . import resources
from .config import (
    KNOBS,
    RULES,
    ConfigError,
    FwdConfig,
    decode_default,
    decode_rescale_reasons,
    ragged_default,
    unsupported_reasons,
)


class ForwardSm90(KernelFamily):
    name = "fa4_fwd_sm90"
    arch = "sm_90a"
    capability = (9, 0)
    gpus = "Hopper GPUs (H100, H200: sm_90a)"
    description = "FA4-style dense forward attention for Hopper (sm_90a)"
    problem_type = Problem
    config_type = FwdConfig
    config_error = ConfigError
    knobs = KNOBS
    default_spaces = ("tiles", "pipeline", "exp2", "softmax")
    rules = RULES
    entry = "attention"
    # What compiles or launches: this folder's kernel, config, resource, compile and launch code,
    # the shared Hopper device code and the shared host launch code. Not the spec, the cost model,
    # its calibration or the peers; not the fp32 reference or the output checks.
    source_globs = ("fa4_fwd_sm90/*.py", "sm90/*.py", "common/*.py")
    source_excludes = (
        "fa4_fwd_sm90/__init__.py",
        "fa4_fwd_sm90/cost_model.py",
        "fa4_fwd_sm90/calibrate.py",
        "fa4_fwd_sm90/peers.py",
        "common/__init__.py",
        "common/reference.py",
        "common/verify.py",
        "common/measure.py",
    )

    # ---- configs and problems -----------------------------------------------------------------
    def default_config(self, problem, target=None) -> FwdConfig:
        """The hand-picked starting point (the search measures from here): per head dim for
        prefill; config.decode_default for decode (packed GQA, 64-row tiles, the split rule)."""
        if problem.regime == "decode":
            return decode_default(problem, target or get_target(None))
        d, dv = problem.head_dim, problem.head_dim_v
        if max(d, dv) <= 64:
            cfg = FwdConfig(tile_m=192, tile_n=128)
        elif max(d, dv) <= 128:
            cfg = FwdConfig(tile_m=128, tile_n=128)
        elif max(d, dv) <= 192:
            cfg = FwdConfig(tile_m=128, tile_n=128 if dv <= 128 else 112)
        else:
            cfg = FwdConfig(tile_m=128, tile_n=80)
        # Rescale O only when a row max rose by more than 2^8: rare after the first blocks, and P
        # stays well inside bf16/fp16 range (measured: +1-7% at 1k tokens, neutral at 16k;
        # docs/kernel-notes.md). Persistent CTAs: non-causal +10% at 1k tokens, +2-3% at 4k, even at
        # 16k; causal (tiles from the kernel's counter) +12-20% at 1k, +5% at 4k, +0.5-1% at 16k
        # (H200, v4 and v5 in docs/kernel-notes.md). The lazy row max (`lazy_max`), in an A/B on the
        # H200: hdim 64 non-causal +6.7-7.5% at 1k-16k, causal +6.4% at 16k, +3.9% at 4k, +0.2% at
        # 1k, -1.6% at 512; hdim 128 +0.9-3.3% (512 causal -0.3%; session 22 in
        # docs/kernel-notes.md; run 11, session 23, searched with it). It needs threshold 8 and the
        # MUFU's exponentials.
        cfg = replace(cfg, rescale_threshold=8.0, persistent=True, lazy_max=True)
        if cfg.persistent and resources.smem_reasons(cfg, problem, target or get_target(None)):
            cfg = replace(cfg, persistent=False)  # O's own buffer does not fit (hdim 192, 256)
        if problem.layout.ragged:
            cfg = ragged_default(cfg, problem)
        if target is not None and self.infeasible_reasons(problem, cfg, target):
            # Fall back to a smaller pipeline before giving up; a problem no config fits is reported
            # by the caller through infeasible_reasons.
            for stages in (1,):
                alt = replace(cfg, num_stages=stages)
                if not self.infeasible_reasons(problem, alt, target):
                    return alt
        return cfg

    def unsupported_reasons(self, problem, target) -> list[str]:
        return unsupported_reasons(problem, target)

    def avoid_reasons(self, problem, config, target) -> list[str]:
        return decode_rescale_reasons(config, problem)

    def problem_from_job(self, fields) -> Problem:
        return Problem.from_job_fields(fields)

    # ---- compiling and launching --------------------------------------------------------------
    def compile_key(self, problem, config, target) -> tuple:
        from .compile import compile_key, layout_of, pack_group_of

        return compile_key(
            config,
            problem.dtype,
            problem.head_dim,
            problem.head_dim_v,
            problem.causal,
            target,
            pack_group_of(config, problem),
            layout_of(problem),
        )

    def compile(self, problem, config, target, *, options=None, use_cache=True):
        from .compile import compile_forward, layout_of, pack_group_of

        return compile_forward(
            config,
            problem.dtype,
            problem.head_dim,
            problem.head_dim_v,
            problem.causal,
            target,
            options=options,
            use_cache=use_cache,
            pack_group=pack_group_of(config, problem),
            layout=layout_of(problem),
        )

    def export(self, compiled, path) -> str:
        from .compile import export_compiled

        return export_compiled(compiled, path)

    def load(self, path, problem, config, target):
        from .compile import layout_of, load_compiled, pack_group_of

        return load_compiled(
            path,
            config,
            problem.dtype,
            problem.head_dim,
            problem.head_dim_v,
            problem.causal,
            target,
            pack_group=pack_group_of(config, problem),
            layout=layout_of(problem),
        )

    def artifact_name(self, key: tuple) -> str:
        from .compile import artifact_name

        return artifact_name(key)

    def launch_arguments(self, problem, config, target) -> dict:
        from .launch import heads_per_l2_group

        return {
            "heads_per_l2_group": heads_per_l2_group(problem, target),
            "tile_counter": bool(config.uses_tile_counter(problem.causal)),
        }

    def prepare_launch(self, problem, config, target, q, k, v, softmax_scale=None, ragged=None):
        from .launch import prepare_launch

        return prepare_launch(problem, config, target, q, k, v, softmax_scale, ragged)

    # ---- measuring on a GPU -------------------------------------------------------------------
    def measurement_case(self, problem, device):
        return attention_measure.attention_case(problem, device)

    def randomize(self, case, seed: int) -> None:
        attention_measure.randomize(case, seed)

    def poison(self, case) -> None:
        attention_measure.poison(case)

    def reference(self, case):
        return attention_measure.reference(case)

    def compare(self, case, reference):
        return attention_measure.check(case, reference)

    def launcher(self, case, config, target):
        from .launch import attention_forward, attention_varlen_forward

        if case.problem.layout.ragged:  # a RaggedCase: its index tensors and varlen outputs

            def run_ragged():
                attention_varlen_forward(
                    case.q,
                    case.k,
                    case.v,
                    config,
                    case.ragged,
                    causal=case.problem.causal,
                    out=case.out,
                    lse=case.lse,
                    target=target,
                )

            return run_ragged

        def run():
            attention_forward(
                case.q,
                case.k,
                case.v,
                config,
                causal=case.problem.causal,
                out=case.out,
                lse=case.lse,
                target=target,
            )

        return run

    def tolerance(self, problem):
        return attention_measure.tolerance(problem)

    # ---- estimates and peers ------------------------------------------------------------------
    def cost_model(self, target, assumptions=None):
        from .cost_model import CostModel, ModelAssumptions

        return CostModel(target, assumptions or ModelAssumptions())

    def peers(self):
        from .peers import PEERS

        return list(PEERS)

    def ragged_peers(self):
        from .peers import RAGGED_PEERS

        return list(RAGGED_PEERS)


FAMILY = ForwardSm90()
