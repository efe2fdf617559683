"""fa4tune: measure-driven autotuning of FlashAttention-4-style attention kernels.

    import fa4tune
    config, how = fa4tune.lookup(fa4tune.Problem(head_dim=128, seqlen_q=8192, causal=True))

Importing fa4tune is cheap: neither torch nor cutlass is imported until a kernel runs."""

__version__ = "0.1.0"

from .problem import Problem  # noqa: E402
from .runtime import LookupResult, lookup  # noqa: E402

# `fa4tune.attention` (issue 4) lives in this module, imported on first use because it needs torch
# and the CuTe DSL.
_ATTENTION_MODULE = "fa4tune.dispatch"


def __getattr__(name: str):
    if name == "attention":
        import importlib

        try:
            module = importlib.import_module(_ATTENTION_MODULE)
        except ModuleNotFoundError as exc:
            if exc.name != _ATTENTION_MODULE:
                raise
            raise AttributeError(
                "fa4tune.attention is not part of this fa4tune version yet (no fa4tune.dispatch module); "
                "use fa4tune.lookup for configs"
            ) from None
        globals()["attention"] = module.attention  # later calls skip this hook
        return module.attention
    raise AttributeError(f"module 'fa4tune' has no attribute {name!r}")


__all__ = ["LookupResult", "Problem", "__version__", "lookup"]
