"""Compiling the backward kernel, and its compiled kernels as object files: as the forward's
(../fa4_fwd_sm90/compile.py), cached per (config, dtype, head dim, causal, arch); shapes are
run-time, GQA's group too."""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass

from ...problem import normalize_dtype
from ...target import Target, get_target
from ..common.dsl import dynamic_tensor, export_object, import_dsl, load_object
from .config import BwdConfig

_CACHE: dict[tuple, CompiledBackward] = {}
_CACHE_LOCK = threading.Lock()


@dataclass
class CompiledBackward:
    kernel: object  # the FlashBackwardSm90 instance (None when loaded from an object file)
    function: object  # what cute.compile returned
    compile_seconds: float
    key: tuple


def compile_key(config: BwdConfig, dtype: str, head_dim: int, causal: bool, target: Target):
    return (config, normalize_dtype(dtype), head_dim, bool(causal), target.arch)


def compile_backward(
    config: BwdConfig,
    dtype: str,
    head_dim: int,
    causal: bool = False,
    target: Target | str | None = None,
    options: str | None = None,
    use_cache: bool = True,
) -> CompiledBackward:
    """Build (or fetch from the cache) the backward kernel for this config; ConfigError, naming the
    knob, for a config that cannot be built, before any compile."""
    target = get_target(target)
    dtype = normalize_dtype(dtype)
    key = compile_key(config, dtype, head_dim, causal, target)
    with _CACHE_LOCK:
        hit = _CACHE.get(key) if use_cache else None
    if hit is not None:
        return hit
    cute = import_dsl(target)
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    from .kernel import DTYPES, FlashBackwardSm90

    kernel = FlashBackwardSm90(config, dtype, head_dim, causal, target)
    elem = DTYPES[dtype]

    # The run-time types launch.py passes (common/dsl.py's dynamic_tensor).

    f32 = cutlass.Float32
    args = (
        *(dynamic_tensor(elem, 4, 16) for _ in range(4)),  # q, k, v, dO
        dynamic_tensor(f32, 3, 16),  # LSE2
        dynamic_tensor(f32, 3, 16),  # D
        dynamic_tensor(f32, 4, 16),  # dQ accumulator
        dynamic_tensor(elem, 4, 16),  # dK
        dynamic_tensor(elem, 4, 16),  # dV
        dynamic_tensor(cutlass.Int32, 3, 4) if config.deterministic else None,
        dynamic_tensor(cutlass.Int32, 1, 4) if config.persistent and causal else None,
        f32(1.0),  # the softmax scale x log2(e)
        f32(1.0),  # the softmax scale
        cutlass.Int32(0),  # log2 of the K/V heads per section of the CTA order
        make_fake_stream(),
    )
    start = time.perf_counter()
    function = (
        cute.compile(kernel, *args, options=options) if options else cute.compile(kernel, *args)
    )
    compiled = CompiledBackward(kernel, function, time.perf_counter() - start, key)
    if use_cache:
        with _CACHE_LOCK:
            compiled = _CACHE.setdefault(key, compiled)
    return compiled


_PREPROCESS_CACHE: dict[tuple, object] = {}


def compile_preprocess(
    dtype: str, head_dim_v: int, head_dim: int, has_dlse: bool, target: Target | str | None = None
):
    """The preprocessing kernel's compiled host function (preprocess.py) for dO and O of this dtype
    and head_dim_v, dQ's accumulator of head_dim columns, with or without a dLSE (one per process
    and key; shapes are run-time)."""
    target = get_target(target)
    dtype = normalize_dtype(dtype)
    key = (dtype, head_dim_v, head_dim, bool(has_dlse), target.arch)
    with _CACHE_LOCK:
        hit = _PREPROCESS_CACHE.get(key)
    if hit is not None:
        return hit
    cute = import_dsl(target)
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    from .kernel import DTYPES
    from .preprocess import BackwardPreprocess

    f32 = cutlass.Float32
    args = (
        dynamic_tensor(DTYPES[dtype], 4, 16),  # dO
        dynamic_tensor(DTYPES[dtype], 4, 16),  # O
        dynamic_tensor(f32, 3, 4),  # LSE
        dynamic_tensor(f32, 3, 4) if has_dlse else None,  # dLSE
        dynamic_tensor(f32, 3, 16),  # LSE2
        dynamic_tensor(f32, 3, 16),  # D
        dynamic_tensor(f32, 4, 16),  # dQ's accumulator
        f32(1.0),  # the softmax scale (run-time)
        make_fake_stream(),
    )
    function = cute.compile(BackwardPreprocess(dtype, head_dim_v, head_dim, has_dlse), *args)
    with _CACHE_LOCK:
        return _PREPROCESS_CACHE.setdefault(key, function)


_POSTPROCESS_CACHE: dict[tuple, object] = {}


def compile_postprocess(dtype: str, head_dim: int, slab: tuple, target: Target | str | None = None):
    """The cast of a dq_flat accumulator into dQ (postprocess.py), for this dtype, head dim and
    slab (config.flat_slab: rows, columns, transposed); one per process and key, shapes
    run-time."""
    target = get_target(target)
    dtype = normalize_dtype(dtype)
    key = (dtype, head_dim, tuple(slab), target.arch)
    with _CACHE_LOCK:
        hit = _POSTPROCESS_CACHE.get(key)
    if hit is not None:
        return hit
    cute = import_dsl(target)
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    from .kernel import DTYPES
    from .postprocess import FlatDqCast

    args = (
        dynamic_tensor(cutlass.Float32, 4, 16),  # the accumulator
        dynamic_tensor(DTYPES[dtype], 4, 16),  # dQ
        make_fake_stream(),
    )
    function = cute.compile(FlatDqCast(dtype, head_dim, *slab), *args)
    with _CACHE_LOCK:
        return _POSTPROCESS_CACHE.setdefault(key, function)


def artifact_name(key: tuple) -> str:
    return "fa4bwd_" + hashlib.sha256(repr(key).encode()).hexdigest()[:24]


def export_compiled(compiled: CompiledBackward, path) -> str:
    """Write a compiled kernel as an object file that `load_compiled` loads in another process
    (common/dsl.export_object)."""
    return export_object(compiled.function, path, artifact_name(compiled.key))


def load_compiled(path, config, dtype, head_dim, causal, target) -> CompiledBackward:
    target = get_target(target)
    key = compile_key(config, dtype, head_dim, causal, target)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    import_dsl(target)
    start = time.perf_counter()
    function = load_object(path, artifact_name(key))
    compiled = CompiledBackward(None, function, time.perf_counter() - start, key)
    with _CACHE_LOCK:
        return _CACHE.setdefault(key, compiled)
