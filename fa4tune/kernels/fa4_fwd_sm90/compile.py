"""Compiling the forward kernel, and its compiled kernels as object files.

Compiled kernels are cached per (config, dtype, head dims, causal, arch, SM count); shapes are
run-time, so one compile serves every batch, seqlen and head count. Compilation needs no GPU: with
CUTE_DSL_ARCH set (done here from the target) the kernel builds for sm_90a on any machine. A compile
worker exports what it compiled (the DSL's AOT export) and the measuring worker loads it in
milliseconds."""

from __future__ import annotations

import hashlib
import threading
import time
from dataclasses import dataclass, replace

from ...problem import InputLayout, Problem, normalize_dtype
from ...target import Target, get_target
from ..common.dsl import dynamic_tensor, export_object, import_dsl, load_object
from . import FAMILY
from .config import FwdConfig

_CACHE: dict[tuple, CompiledForward] = {}
_CACHE_LOCK = threading.Lock()


@dataclass
class CompiledForward:
    kernel: object  # the FlashForwardSm90 instance (None when loaded from an exported object file)
    function: object  # what cute.compile returned
    compile_seconds: float
    key: tuple


def compile_key(
    config: FwdConfig,
    dtype: str,
    head_dim: int,
    head_dim_v: int,
    causal: bool,
    target: Target,
    pack_group: int = 1,
    layout: InputLayout | None = None,
) -> tuple:
    # The SM count too: a persistent kernel's grid is sized by it at compile time. Every split count
    # above 1 is one kernel (the count is the partials' extent); packed GQA compiles its group in,
    # ragged inputs their layout (batch-shaped ones add nothing, so their keys stay as they were).
    config = config.canonical()
    if config.num_splits > 2:
        config = replace(config, num_splits=2)
    key = (
        config,
        normalize_dtype(dtype),
        head_dim,
        head_dim_v,
        bool(causal),
        target.arch,
        target.sm_count,
    )
    key += (pack_group,) if config.pack_gqa else ()
    return key + ((layout,) if layout is not None and layout.ragged else ())


def layout_of(problem: Problem) -> InputLayout | None:
    """The input layout a problem compiles in: None for batch-shaped tensors."""
    return problem.layout if problem.layout.ragged else None


def pack_group_of(config: FwdConfig, problem: Problem) -> int:
    """The group size a config compiles in for a problem: its query heads per K/V head with
    packed GQA, else 1."""
    return problem.qheads_per_kvhead if config.pack_gqa else 1


def compile_forward(
    config: FwdConfig,
    dtype: str,
    head_dim: int,
    head_dim_v: int | None = None,
    causal: bool = False,
    target: Target | str | None = None,
    options: str | None = None,
    use_cache: bool = True,
    pack_group: int = 1,
    layout: InputLayout | None = None,
) -> CompiledForward:
    """Build (or fetch from the cache) the kernel for this config. Raises ConfigError, naming the
    knob, for a config that cannot be built, before any compile. `use_cache=False` always compiles
    (to see the compiler's report, say) and leaves the cache as it was. `layout`: ragged inputs
    (None: batch-shaped)."""
    target = get_target(target)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    dtype = normalize_dtype(dtype)
    layout = layout or InputLayout()
    key = compile_key(config, dtype, head_dim, head_dim_v, causal, target, pack_group, layout)
    with _CACHE_LOCK:
        hit = _CACHE.get(key) if use_cache else None
    if hit is not None:
        return hit
    FAMILY.check(
        Problem(
            dtype=dtype,
            head_dim=head_dim,
            head_dim_v=head_dim_v,
            causal=causal,
            nheads_q=pack_group,
            nheads_kv=1,
            **layout.stand_in(),
        ),
        config,
        target,
    )
    cute = import_dsl(target)
    import cutlass
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from .kernel import DTYPES, FlashForwardSm90

    kernel = FlashForwardSm90(
        key[0], dtype, head_dim, head_dim_v, causal, target, pack_group=pack_group, layout=layout
    )
    elem = DTYPES[dtype]

    # Fake arguments with exactly the run-time types that attention_forward passes (common/dsl.py's
    # dynamic_tensor); the tile counter, a (1,) tensor of static layout.
    from cutlass.cute import AddressSpace

    # Ragged inputs: varlen q and O are (total, heads, d) and LSE (heads, total); varlen k and v
    # (total, heads, d); pages (pages, page_size, heads, d). Split partials keep their rank (varlen:
    # one batch of all rows).
    q_rank = 3 if layout.varlen_q else 4
    kv_rank = 3 if layout.varlen_k else 4
    bshd = [dynamic_tensor(elem, q_rank, 16)] + [dynamic_tensor(elem, kv_rank, 16) for _ in "kv"]
    if config.split:  # O and LSE: the fp32 partials, with a split mode first
        bshd.append(dynamic_tensor(cutlass.Float32, 5, 16))
        lse = dynamic_tensor(cutlass.Float32, 4, 4)
    else:
        bshd.append(dynamic_tensor(elem, q_rank, 16))
        lse = dynamic_tensor(cutlass.Float32, q_rank - 1, 4)
    counter = make_fake_tensor(
        cutlass.Int32, (1,), stride=(1,), memspace=AddressSpace.generic, assumed_align=4
    )
    if config.combine_in_kernel:  # the tiles' split counts instead: (tiles,)
        counter = dynamic_tensor(cutlass.Int32, 1, 4)
    index = dict(cu_seqlens_q=layout.varlen_q, cu_seqlens_k=layout.varlen_k)
    index.update(seqused_k=layout.seqused_k, page_table=layout.paged)
    ragged = [
        (dynamic_tensor(cutlass.Int32, 2 if name == "page_table" else 1, 4) if used else None)
        for name, used in index.items()
    ]
    start = time.perf_counter()
    args = (*bshd, lse, counter, cutlass.Float32(1.0), cutlass.Int32(1), make_fake_stream())
    if layout.ragged or config.combine_in_kernel:
        args += tuple(ragged)
    if config.combine_in_kernel:  # O and LSE, which the last split CTA of each tile writes
        args += (dynamic_tensor(elem, 4, 16), dynamic_tensor(cutlass.Float32, 3, 4))
    function = (
        cute.compile(kernel, *args, options=options) if options else cute.compile(kernel, *args)
    )
    compiled = CompiledForward(kernel, function, time.perf_counter() - start, key)
    if use_cache:
        with _CACHE_LOCK:
            compiled = _CACHE.setdefault(key, compiled)
    return compiled


_COMBINE_CACHE: dict[tuple, object] = {}


def compile_combine(dtype: str, head_dim_v: int, target: Target | str | None = None):
    """The split-KV combine kernel's compiled host function for O of this dtype and head_dim_v (one
    per process and key; it takes every split count and shape)."""
    target = get_target(target)
    dtype = normalize_dtype(dtype)
    key = (dtype, head_dim_v, target.arch)
    with _CACHE_LOCK:
        hit = _COMBINE_CACHE.get(key)
    if hit is not None:
        return hit
    cute = import_dsl(target)
    import cutlass
    from cutlass.cute.runtime import make_fake_stream

    from .combine import SplitCombine
    from .kernel import DTYPES

    f32 = cutlass.Float32
    args = (
        dynamic_tensor(f32, 5, 16),
        dynamic_tensor(f32, 4, 4),
        dynamic_tensor(DTYPES[dtype], 4, 16),
        dynamic_tensor(f32, 3, 4),
        make_fake_stream(),
    )
    function = cute.compile(SplitCombine(dtype, head_dim_v), *args)
    with _CACHE_LOCK:
        return _COMBINE_CACHE.setdefault(key, function)


def artifact_name(key: tuple) -> str:
    """A file-name-safe name for a compile key (the symbol prefix of its exported object too)."""
    return "fa4fwd_" + hashlib.sha256(repr(key).encode()).hexdigest()[:24]


def export_compiled(compiled: CompiledForward, path) -> str:
    """Write a compiled kernel as an object file that `load_compiled` loads in another process
    (common/dsl.export_object)."""
    return export_object(compiled.function, path, artifact_name(compiled.key))


def load_compiled(
    path,
    config: FwdConfig,
    dtype: str,
    head_dim: int,
    head_dim_v: int | None = None,
    causal: bool = False,
    target: Target | str | None = None,
    pack_group: int = 1,
    layout: InputLayout | None = None,
) -> CompiledForward:
    """Load a kernel that `export_compiled` wrote (in any process) into this process's compile
    cache, so that compile_forward and attention_forward find it. Milliseconds instead of
    seconds."""
    target = get_target(target)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    key = compile_key(config, dtype, head_dim, head_dim_v, causal, target, pack_group, layout)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    import_dsl(target)
    start = time.perf_counter()
    function = load_object(path, artifact_name(key))
    compiled = CompiledForward(None, function, time.perf_counter() - start, key)
    with _CACHE_LOCK:
        return _CACHE.setdefault(key, compiled)
