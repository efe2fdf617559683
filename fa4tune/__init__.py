"""fa4tune: measure-driven autotuning of FlashAttention-4-style attention kernels.

    import fa4tune
    config, how = fa4tune.lookup(fa4tune.Problem(head_dim=128, seqlen_q=8192, causal=True))

Importing fa4tune is cheap: neither torch nor cutlass is imported until a kernel runs."""

__version__ = "0.1.0"

from .problem import Problem  # noqa: E402
from .runtime import LookupResult, lookup  # noqa: E402

# `fa4tune.attention` lives in fa4tune.dispatch, imported on first use because it needs torch and the
# CuTe DSL.


def __getattr__(name: str):
    if name == "attention":
        from .dispatch import attention

        globals()["attention"] = attention  # later calls skip this hook
        return attention
    raise AttributeError(f"module 'fa4tune' has no attribute {name!r}")


__all__ = ["LookupResult", "Problem", "__version__", "lookup"]
