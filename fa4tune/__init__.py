"""fa4tune: measure-driven autotuning of FlashAttention-4-style attention kernels.

    import fa4tune
    config, how = fa4tune.lookup(fa4tune.Problem(head_dim=128, seqlen_q=8192, causal=True))

Importing fa4tune is cheap: neither torch nor cutlass is imported until a kernel runs."""

__version__ = "0.1.0"

from .problem import Problem  # noqa: E402
from .runtime.lookup import LookupResult, lookup  # noqa: E402

# `fa4tune.attention` and `fa4tune.attention_varlen` (fa4tune.runtime.ops, which registers the torch
# ops), `fa4tune.explain` and `fa4tune.explain_varlen` (fa4tune.runtime.dispatch) are imported on
# first use: a call needs torch and the CuTe DSL.
_LAZY = {
    "attention": "ops",
    "explain": "dispatch",
    "attention_varlen": "ops",
    "explain_varlen": "dispatch",
}


def __getattr__(name: str):
    if name in _LAZY:
        from importlib import import_module

        value = getattr(import_module(f".runtime.{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later uses skip this hook
        return value
    raise AttributeError(f"module 'fa4tune' has no attribute {name!r}")


__all__ = [
    "LookupResult",
    "Problem",
    "__version__",
    "attention",
    "attention_varlen",
    "explain",
    "explain_varlen",
    "lookup",
]
