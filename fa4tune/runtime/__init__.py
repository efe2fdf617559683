"""What runs at inference time: the lookup of tuned configs (lookup.py), the dispatcher behind
fa4tune.attention (dispatch.py), exported tables (tables.py) and carrying them over a refactor
(carry.py). Importing this package imports neither torch nor the CuTe DSL."""

from .lookup import LookupResult, reset

__all__ = ["LookupResult", "reset"]
