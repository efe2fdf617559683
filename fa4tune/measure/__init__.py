"""Measurement backends: `model` (analytic cost model, CPU) and `gpu` (compile, time and verify on a
GPU; issue 4), selected by name, with `auto` choosing the GPU when one is present."""

from .base import BACKENDS, Backend, Measurement, backend_class, make_backend, resolve_backend_name

__all__ = [
    "BACKENDS",
    "Backend",
    "Measurement",
    "backend_class",
    "make_backend",
    "resolve_backend_name",
]
