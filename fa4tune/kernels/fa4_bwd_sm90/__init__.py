"""fa4_bwd_sm90: the backward kernel for Hopper (dQ, dK, dV of batch-shaped attention), as a
kernel family.

    config.py    the knobs (BwdConfig), their legal values, the resource model, the feasibility
                 rules, the default
    kernel.py    the CuTe DSL kernel (FlashBackwardSm90)
    compile.py   compiling, the compile cache, object files
    launch.py    attention_backward: LSE2 and D, the kernel, dQ from its accumulator

Its problems are the forward's (fa4tune.problem.Problem): a backward table is keyed by this
family's name, so the forward's tables stay as they are."""

from __future__ import annotations

from ...problem import Problem
from ...target import get_target
from ..family import KernelFamily
from .config import KNOBS, RULES, BwdConfig, ConfigError, default_config, unsupported_reasons


class BackwardSm90(KernelFamily):
    name = "fa4_bwd_sm90"
    arch = "sm_90a"
    capability = (9, 0)
    gpus = "Hopper GPUs (H100, H200: sm_90a)"
    description = "FA4-style attention backward (dQ, dK, dV) for Hopper (sm_90a)"
    problem_type = Problem
    config_type = BwdConfig
    config_error = ConfigError
    knobs = KNOBS
    default_spaces = ("backward",)
    rules = RULES
    entry = "attention_backward"
    # What compiles or launches: this folder's kernel, config, compile and launch code, the shared
    # Hopper device code and the shared host launch code; not the spec, the measurement, the cost
    # model or the peers, nor the fp32 references and checks.
    source_globs = ("fa4_bwd_sm90/*.py", "sm90/*.py", "common/*.py")
    source_excludes = (
        "fa4_bwd_sm90/__init__.py",
        "fa4_bwd_sm90/measure.py",
        "fa4_bwd_sm90/cost_model.py",
        "fa4_bwd_sm90/peers.py",
        "common/__init__.py",
        "common/reference.py",
        "common/verify.py",
        "common/measure.py",
    )

    def default_config(self, problem, target=None) -> BwdConfig:
        return default_config(problem, target or get_target(None))

    def unsupported_reasons(self, problem, target) -> list[str]:
        return unsupported_reasons(problem, target)

    def problem_from_job(self, fields) -> Problem:
        return Problem.from_job_fields(fields)

    def compile_key(self, problem, config, target) -> tuple:
        from .compile import compile_key

        return compile_key(config, problem.dtype, problem.head_dim, problem.causal, target)

    def compile(self, problem, config, target, *, options=None, use_cache=True):
        from .compile import compile_backward

        return compile_backward(
            config,
            problem.dtype,
            problem.head_dim,
            problem.causal,
            target,
            options=options,
            use_cache=use_cache,
        )

    def export(self, compiled, path) -> str:
        from .compile import export_compiled

        return export_compiled(compiled, path)

    def load(self, path, problem, config, target):
        from .compile import load_compiled

        return load_compiled(path, config, problem.dtype, problem.head_dim, problem.causal, target)

    def artifact_name(self, key: tuple) -> str:
        from .compile import artifact_name

        return artifact_name(key)

    # ---- measuring on a GPU -------------------------------------------------------------------
    def measurement_case(self, problem, device):
        from .measure import backward_case

        return backward_case(problem, device)

    def randomize(self, case, seed: int) -> None:
        from .measure import randomize

        randomize(case, seed)

    def poison(self, case) -> None:
        from .measure import poison

        poison(case)

    def reference(self, case):
        from .measure import reference

        return reference(case)

    def compare(self, case, reference):
        from .measure import check

        return check(case, reference)

    def launcher(self, case, config, target):
        from .launch import attention_backward

        def run():
            attention_backward(
                case.dout,
                case.q,
                case.k,
                case.v,
                case.out,
                case.lse,
                config,
                causal=case.problem.causal,
                target=target,
                grads=(case.dq, case.dk, case.dv),
            )

        return run

    def tolerance(self, problem):
        from .measure import tolerance

        return tolerance(problem)

    # ---- estimates and peers ------------------------------------------------------------------
    def work_flops(self, problem) -> float:
        """The backward's five GEMMs against the forward's two: 2.5x its FLOPs."""
        return 2.5 * problem.flops

    def cost_model(self, target, assumptions=None):
        from .cost_model import BackwardCostModel

        return BackwardCostModel(target)

    def peers(self):
        from .peers import PEERS

        return list(PEERS)


FAMILY = BackwardSm90()
