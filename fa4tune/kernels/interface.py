"""Compile and run the forward kernel on torch tensors.

Compiled kernels are cached per (config, dtype, head dims, causal, arch); shapes are run-time, so one
compile serves every batch, seqlen and head count. Compilation needs no GPU: with CUTE_DSL_ARCH set
(done here from the target) the kernel builds for sm_90a on any machine.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass

from ..problem import Problem, normalize_dtype
from ..target import Target, get_target
from .config import FwdConfig, check_config

_CACHE: dict[tuple, "CompiledForward"] = {}
_CACHE_LOCK = threading.Lock()


@dataclass
class CompiledForward:
    kernel: object  # the FlashForwardSm90 instance (None when loaded from an exported object file)
    function: object  # what cute.compile returned
    compile_seconds: float
    key: tuple


def _import_dsl(target: Target):
    # The DSL reads its target arch once, when it is first imported.
    os.environ.setdefault("CUTE_DSL_ARCH", target.arch)
    import cutlass  # noqa: F401
    import cutlass.cute as cute

    return cute


def compile_key(config: FwdConfig, dtype: str, head_dim: int, head_dim_v: int, causal: bool,
                target: Target) -> tuple:
    # The SM count too: a persistent kernel's grid is sized by it at compile time.
    return (config.canonical(), normalize_dtype(dtype), head_dim, head_dim_v, bool(causal), target.arch,
            target.sm_count)


def compile_forward(
    config: FwdConfig,
    dtype: str,
    head_dim: int,
    head_dim_v: int | None = None,
    causal: bool = False,
    target: Target | str | None = None,
    options: str | None = None,
    use_cache: bool = True,
) -> CompiledForward:
    """Build (or fetch from the cache) the kernel for this config. Raises ConfigError, naming the
    knob, for a config that cannot be built, before any compile. `use_cache=False` always compiles
    (to see the compiler's report, say) and leaves the cache as it was."""
    target = get_target(target)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    dtype = normalize_dtype(dtype)
    key = compile_key(config, dtype, head_dim, head_dim_v, causal, target)
    with _CACHE_LOCK:
        hit = _CACHE.get(key) if use_cache else None
    if hit is not None:
        return hit
    check_config(Problem(dtype=dtype, head_dim=head_dim, head_dim_v=head_dim_v, causal=causal),
                 config, target)
    cute = _import_dsl(target)
    import cutlass
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from .fwd_sm90 import DTYPES, FlashForwardSm90

    kernel = FlashForwardSm90(config.canonical(), dtype, head_dim, head_dim_v, causal, target)
    elem = DTYPES[dtype]

    # Fake arguments with exactly the run-time types that attention_forward passes (from_dlpack with
    # mark_layout_dynamic): every extent a dynamic i32, every stride but the last a dynamic i64. The
    # compiled function trusts its callers' argument layout, so the two must match.
    from cutlass.cute import AddressSpace

    def dynamic_tensor(dtype, rank: int, align: int):
        return make_fake_tensor(dtype, tuple(cute.sym_int32() for _ in range(rank)),
                                stride=tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,),
                                memspace=AddressSpace.generic, assumed_align=align)

    bshd = [dynamic_tensor(elem, 4, 16) for _ in range(4)]
    lse = dynamic_tensor(cutlass.Float32, 3, 4)
    counter = make_fake_tensor(cutlass.Int32, (1,), stride=(1,), memspace=AddressSpace.generic, assumed_align=4)
    start = time.perf_counter()
    args = (*bshd, lse, counter,
            cutlass.Float32(1.0), cutlass.Int32(1), make_fake_stream())
    function = cute.compile(kernel, *args, options=options) if options else cute.compile(kernel, *args)
    compiled = CompiledForward(kernel, function, time.perf_counter() - start, key)
    if use_cache:
        with _CACHE_LOCK:
            compiled = _CACHE.setdefault(key, compiled)
    return compiled


def artifact_name(key: tuple) -> str:
    """A file-name-safe name for a compile key (the symbol prefix of its exported object too)."""
    import hashlib

    return "fa4fwd_" + hashlib.sha256(repr(key).encode()).hexdigest()[:24]


def export_compiled(compiled: CompiledForward, path) -> str:
    """Write a compiled kernel as an object file (the DSL's AOT export) that `load_compiled` loads in
    another process. Written under a temporary name and renamed: a reader never sees half a file."""
    import tempfile
    from pathlib import Path

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    name = artifact_name(compiled.key)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as tmp:
        compiled.function.export_to_c(tmp, name, function_prefix=name)
        os.replace(os.path.join(tmp, name + ".o"), path)
    return str(path)


def load_compiled(path, config: FwdConfig, dtype: str, head_dim: int, head_dim_v: int | None = None,
                  causal: bool = False, target: Target | str | None = None) -> CompiledForward:
    """Load a kernel that `export_compiled` wrote (in any process) into this process's compile
    cache, so that compile_forward and attention_forward find it. Milliseconds instead of seconds."""
    target = get_target(target)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    key = compile_key(config, dtype, head_dim, head_dim_v, causal, target)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    _import_dsl(target)
    from cutlass.cute.runtime import load_module

    start = time.perf_counter()
    function = load_module(str(path))[artifact_name(key)]
    compiled = CompiledForward(None, function, time.perf_counter() - start, key)
    with _CACHE_LOCK:
        return _CACHE.setdefault(key, compiled)


def heads_per_l2_group(problem: Problem, target: Target) -> int:
    """How many (batch, head) pairs to run side by side so that their K/V stay in half the L2."""
    kv_bytes = problem.seqlen_k * (problem.head_dim + problem.head_dim_v) * 2 / problem.qheads_per_kvhead
    fit = max(1, int((target.l2_bytes / 2) // max(kv_bytes, 1)))
    group = 1 << (fit.bit_length() - 1)
    return max(1, min(group, problem.batch * problem.nheads_q))


_COUNTERS: dict = {}
_COUNTERS_LOCK = threading.Lock()


class _StreamQueries:
    """The two driver queries tile_counter makes per call: is the stream capturing a graph, and its
    unique id (the launch paths ask torch instead, except for external streams: current_tile_counter).
    Called through ctypes on libcuda, the cuda-python bindings where libcuda cannot be opened that
    way (which cost a few microseconds more per call on the H200's host; README, Dispatch)."""

    def __init__(self) -> None:
        import ctypes
        import ctypes.util

        self.lib = None
        for name in ("libcuda.so.1", None):
            try:
                name = name or ctypes.util.find_library("cuda")  # asked only if the first fails
                lib = ctypes.CDLL(name) if name else None
            except OSError:
                continue
            if lib is not None and not hasattr(lib, "cuStreamGetId"):
                lib = None  # a driver before CUDA 12.0: the bindings say what is missing
            if lib is not None:
                lib.cuStreamGetId.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong)]
                lib.cuStreamIsCapturing.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
                lib.cuStreamGetId.restype = lib.cuStreamIsCapturing.restype = ctypes.c_int
                self.lib = lib
                break
        self.ctypes = ctypes

    def _query(self, name: str, stream: int, out_type) -> int:
        """The value the driver function `name` writes for `stream`; RuntimeError on a driver error."""
        if self.lib is None:
            from cuda.bindings import driver as cuda

            err, value = getattr(cuda, name)(cuda.CUstream(stream))  # value None when err is set
            code = int(err)
        else:
            out = out_type()
            code = getattr(self.lib, name)(stream, self.ctypes.byref(out))
            value = out.value
        if code:
            raise RuntimeError(f"{name} failed for stream {stream:#x}: CUDA driver error {code}")
        return int(value)

    def stream_id(self, stream: int) -> int:
        return self._query("cuStreamGetId", stream, self.ctypes.c_ulonglong)

    def capturing(self, stream: int) -> bool:
        return self._query("cuStreamIsCapturing", stream, self.ctypes.c_int) != 0  # 0: CU_STREAM_CAPTURE_STATUS_NONE


_QUERIES: list = []


def _queries() -> _StreamQueries:
    if not _QUERIES:
        _QUERIES.append(_StreamQueries())
    return _QUERIES[0]


def _stream_key(device, stream: int) -> tuple:
    """(device, the driver's unique id of the stream): unlike a handle, the id of a destroyed stream
    is never given to a new one, so a new stream cannot inherit a counter that old work still uses."""
    return device, _queries().stream_id(stream)


def _capturing(stream: int) -> bool:
    return _queries().capturing(stream)


def _indexed(device):
    """`device` as a torch.device with its index ("cuda" alone: the current device)."""
    import torch

    if isinstance(device, torch.device) and device.index is not None:
        return device
    device = torch.device(device)
    return device if device.index is not None else torch.device(device.type, torch.cuda.current_device())


def current_device_getter():
    """torch.cuda.current_device without its checks (torch's C function), where torch has it."""
    import torch

    return getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def _cached(table: dict, key, make):
    """table[key], made by `make()` the first time (under the lock, so once; read without it)."""
    value = table.get(key)
    if value is None:
        with _COUNTERS_LOCK:
            value = table.get(key)
            if value is None:
                value = table[key] = make()
    return value


def tile_counter(device, stream: int):
    """The (1,) int32 tile counter for a launch on `stream` (its handle) of `device`. A kernel whose
    CTAs take tiles from the counter needs it at zero when it starts, and leaves it at zero when it
    has run to the end; launches that could overlap must not share one. So each stream has its own,
    zeroed once (in order on that stream); while the stream captures a CUDA graph every call gets a
    new one, zeroed inside the graph, so that a graph never shares its counter with eager calls or
    with another graph. Counters of destroyed streams are not freed (4 bytes each). The stream's
    driver queries run in `device`'s context (the legacy stream, handle 0, is per context)."""
    import torch

    device = _indexed(device)
    if current_device_getter()() != device.index:
        with torch.cuda.device(device):
            return tile_counter(device, stream)
    if _capturing(stream):
        return _zeroed_counter(device)
    return _cached(_COUNTERS, _stream_key(device, stream), lambda: _zeroed_counter(device))


_UNUSED: dict = {}


def unused_counter(device):
    """What a kernel that ignores the tile counter is given for it (it has the argument all the
    same): one int32 per device, never read or written, so no allocation per call. It is left
    uninitialised: if the first call comes during a graph capture, the graph's pool provides it and
    the graph records no node for it."""
    import torch

    device = _indexed(device)
    return _cached(_UNUSED, device, lambda: torch.empty(1, dtype=torch.int32, device=device))


_TORCH_STREAMS: list = []


def _torch_streams():
    """torch's C functions for the current device and stream: (the current device's index, is its
    current stream capturing, (the torch id, device index, device type) of device i's current
    stream, that stream's handle); None where this torch lacks one of them."""
    if not _TORCH_STREAMS:
        import torch

        names = ("_cuda_isCurrentStreamCapturing", "_cuda_getCurrentStream", "_cuda_getCurrentRawStream")
        functions = (current_device_getter(), *(getattr(torch._C, name, None) for name in names))
        _TORCH_STREAMS.append(functions if all(functions) else None)
    return _TORCH_STREAMS[0]


def current_tile_counter(device):
    """The tile counter for a launch on torch's current stream of `device`, under tile_counter's
    rules (one per stream, a new one per call while the stream captures), but without the two
    driver queries where torch can answer (they cost several microseconds per causal call; README,
    Dispatch). torch's own capture state stands for the driver's, and a stream that torch made is
    named by torch's id: torch never destroys its pool's streams, and the legacy stream (handle 0)
    lives as long as the context, so the id cannot pass to another stream. An external stream
    (torch's id is its handle, which a new stream can get once it is destroyed) still goes by the
    driver's id."""
    torch_streams = _TORCH_STREAMS[0] if _TORCH_STREAMS else _torch_streams()
    index = getattr(device, "index", None)  # a torch.device's; per call, so no import and no _indexed
    if torch_streams is None or not isinstance(index, int) or torch_streams[0]() != index:
        device = _indexed(device)
        return tile_counter(device, _current_handle(device))
    _, capturing, current_stream, raw_stream = torch_streams
    if capturing():
        return _zeroed_counter(device)
    torch_id = current_stream(index)[0]
    handle = raw_stream(index)
    if handle and (torch_id == handle or not torch_id & 1):  # native ids are odd, external ones the handle
        return tile_counter(device, handle)
    key = (device, "torch", torch_id)
    counter = _COUNTERS.get(key)  # (not `or`: a tensor's truth would read it back from the GPU)
    return counter if counter is not None else _cached(_COUNTERS, key, lambda: _zeroed_counter(device))


def _current_handle(device) -> int:
    import torch

    return torch.cuda.current_stream(device).cuda_stream


def _zeroed_counter(device):
    import torch

    return torch.zeros(1, dtype=torch.int32, device=device)


def launch_counter(config: FwdConfig, causal: bool, device):
    """The counter argument of one launch on torch's current stream of `device`: that stream's tile
    counter if this kernel uses it."""
    if config.uses_tile_counter(causal):
        return current_tile_counter(device)
    return unused_counter(device)


class UnsupportedInput(ValueError):
    """An input fa4tune.attention cannot take; the message names what and what it takes."""


def problem_of(q, k, v, causal) -> Problem:
    """The Problem of three tensors, or UnsupportedInput naming what is not supported (empty inputs
    too: they have no problem to look up or tune). Checks all but the device, so that it runs on CPU
    and meta tensors too."""
    if check_inputs(q, k, v, causal):
        raise UnsupportedInput(f"empty inputs (q {tuple(q.shape)}, k {tuple(k.shape)}) have nothing to look up "
                               "or tune")
    return make_problem(q, k, v, causal)


def make_problem(q, k, v, causal) -> Problem:
    """The Problem of inputs that check_inputs passed, not empty."""
    return Problem(dtype=str(q.dtype), head_dim=q.shape[3], head_dim_v=v.shape[3], causal=causal,
                   seqlen_q=q.shape[1], seqlen_k=k.shape[1], batch=q.shape[0], nheads_q=q.shape[2],
                   nheads_kv=k.shape[2])


def check_inputs(q, k, v, causal) -> bool:
    """UnsupportedInput naming what is not supported, for every check but the device (so that it runs
    on CPU and meta tensors too; fa4tune.attention and attention_forward both validate their inputs
    here). True when there is nothing to compute: no batch, no query rows or no keys. The callers then
    return O zero and LSE -inf, as flash-attn-4 does (and this kernel for rows without keys), without
    a launch."""
    import torch

    from .config import SUPPORTED_HEAD_DIMS

    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise UnsupportedInput(f"attention takes torch tensors; {name} is a {type(t).__name__}")
        if t.layout is not torch.strided or t.is_nested:
            raise UnsupportedInput(f"attention takes dense tensors; {name} is "
                                   f"{'nested' if t.is_nested else t.layout}")
        if t.dim() != 4:
            raise UnsupportedInput(f"attention takes 4-D tensors (batch, seqlen, heads, head_dim); "
                                   f"{name} has shape {tuple(t.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise UnsupportedInput(f"attention takes bfloat16 or float16 tensors; q is {q.dtype} "
                               "(convert with q.to(torch.bfloat16))")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise UnsupportedInput(f"q, k and v must have one dtype; q is {q.dtype}, {name} is {t.dtype}")
    for name, dim in (("head_dim of q and k", q.shape[3]), ("head_dim of v", v.shape[3])):
        if dim not in SUPPORTED_HEAD_DIMS:
            raise UnsupportedInput(f"{name} is {dim}; the kernel supports head dims "
                                   f"{', '.join(map(str, SUPPORTED_HEAD_DIMS))}")
    if k.shape[3] != q.shape[3]:
        raise UnsupportedInput(f"q and k must have the same head_dim; q is {tuple(q.shape)}, k is {tuple(k.shape)}")
    if k.shape[:3] != v.shape[:3]:
        raise UnsupportedInput(f"k and v must agree in batch, seqlen and heads; k is {tuple(k.shape)}, "
                               f"v is {tuple(v.shape)}")
    if k.shape[0] != q.shape[0]:
        raise UnsupportedInput(f"q and k must have the same batch size; q is {tuple(q.shape)}, k is {tuple(k.shape)}")
    if q.shape[2] == 0 or k.shape[2] == 0:
        raise UnsupportedInput(f"q, k and v need at least one head; q is {tuple(q.shape)}, k is {tuple(k.shape)}")
    if q.shape[2] % k.shape[2]:
        raise UnsupportedInput(f"the heads of q ({q.shape[2]}) must be a multiple of the heads of k and v "
                               f"({k.shape[2]}) (grouped-query attention)")
    if not isinstance(causal, bool):
        raise UnsupportedInput(f"causal must be True or False, got {causal!r}")
    if 0 in (q.shape[0], q.shape[1], k.shape[1]):
        return True  # nothing is read, so neither strides nor alignment matter
    for name, t in (("q", q), ("k", k), ("v", v)):
        if 0 in t.stride():
            # An expanded view (k[:, :, :1].expand(...), say), or a size-1 dim given stride 0 (which torch
            # calls contiguous): the DSL's DLPack import takes a zero stride for a constant and misreads
            # the descriptor. (GQA needs no expansion: pass k and v with their own heads.)
            raise UnsupportedInput(f"{name} has a zero stride {t.stride()} (an expanded view?); pass "
                                   f"{name}.clone(memory_format=torch.contiguous_format), or k and v with fewer "
                                   "heads than q (GQA)")
        if t.stride(-1) != 1:
            raise UnsupportedInput(f"{name} must be contiguous in its last dimension (head_dim); its strides are "
                                   f"{t.stride()} (use {name}.contiguous())")
        if any(s % 8 for s in t.stride()[:-1]):
            # .contiguous() returns a tensor whose only odd strides are of size-1 dims unchanged.
            raise UnsupportedInput(f"{name}'s strides {t.stride()} must be multiples of 8 elements (16 bytes, "
                                   f"for the TMA), those of size-1 dims too; use "
                                   f"{name}.clone(memory_format=torch.contiguous_format)")
    return False


def empty_outputs(q, v, out=None, lse=None):
    """(out, lse) of attention with nothing to compute (check_inputs said so): O zero (a row without
    keys sums nothing) and LSE -inf (log of that empty sum; flash-attn-4's convention, where FA2/FA3
    write +inf), into `out` and `lse` when given."""
    import torch

    batch, seqlen_q, nheads_q, _ = q.shape
    out_shape, lse_shape = (batch, seqlen_q, nheads_q, v.shape[3]), (batch, nheads_q, seqlen_q)
    if out is None:
        out = torch.zeros(out_shape, dtype=q.dtype, device=q.device)
    else:
        check_output("out", out, out_shape, q.dtype, q.device)
        out.zero_()
    if lse is None:
        lse = torch.full(lse_shape, -math.inf, dtype=torch.float32, device=q.device)
    else:
        check_output("lse", lse, lse_shape, torch.float32, q.device, align=4)
        lse.fill_(-math.inf)
    return out, lse


def check_no_grad(q, k, v) -> None:
    """UnsupportedInput when autograd would record this call: the kernel has no backward, and
    outputs without a grad_fn would leave q, k and v without gradients, silently."""
    import torch

    if (q.requires_grad or k.requires_grad or v.requires_grad) and torch.is_grad_enabled():
        raise UnsupportedInput("fa4tune.attention is forward only (no backward), and q, k or v requires grad: "
                               "call it under torch.no_grad() or torch.inference_mode(), or pass detached tensors")


def check_device(q, k, v, aligned: bool = True) -> None:
    """CUDA tensors on one device, each starting 16-byte aligned (TMA; not checked with `aligned`
    False: inputs with nothing to compute are not read), or UnsupportedInput."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_cuda:
            raise UnsupportedInput(f"attention needs CUDA tensors; {name} is on {t.device}")
        if t.device != q.device:
            raise UnsupportedInput(f"q, k and v must be on one device; q is on {q.device}, {name} on {t.device}")
        if aligned and t.data_ptr() % 16:
            raise UnsupportedInput(f"{name} must start at a 16-byte aligned address (for the TMA); "
                                   f"pass {name}.clone()")


def check_output(name: str, t, shape: tuple, dtype, device, align: int = 16) -> None:
    """An output tensor the caller passed (attention_forward's out or lse): the kernel writes it
    with its own strides, so anything but this shape, dtype and device, a unit last stride and an
    `align`-byte aligned start (16 for the TMA store of out), or UnsupportedInput."""
    import torch

    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided or t.is_nested:
        raise UnsupportedInput(f"{name} must be a dense torch tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise UnsupportedInput(f"{name} must be {tuple(shape)} {dtype} on {device}; it is {tuple(t.shape)} "
                               f"{t.dtype} on {t.device}")
    if t.stride(-1) != 1 or 0 in t.stride() or t.data_ptr() % align or _overlapping(t):
        raise UnsupportedInput(f"{name} must be contiguous in its last dimension, without zero strides or "
                               f"elements that share memory, and start {align}-byte aligned; its strides are "
                               f"{t.stride()}")


def _overlapping(t) -> bool:
    """Whether two elements of t share memory (the kernel's writes to them would race): each dim's
    stride, in increasing order, must step over everything the smaller ones span."""
    span = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size > 1):
        if stride < span:
            return True
        span = stride * size
    return False


def check_grid(config: FwdConfig, problem: Problem) -> None:
    """UnsupportedInput when the config's launch grid cannot hold the problem (config.grid_reasons)."""
    from .config import grid_reasons

    reasons = grid_reasons(config, problem)
    if reasons:
        raise UnsupportedInput(f"config {config.short()} cannot launch {problem.key()}: {'; '.join(reasons)}; "
                               "split the batch (or the heads)")


def attention_forward(q, k, v, config: FwdConfig, causal: bool = False, softmax_scale: float | None = None,
                      out=None, lse=None, target: Target | str | None = None):
    """Run the kernel on CUDA tensors on the current stream. Returns (out, lse): out like q with
    head_dim_v, lse (batch, nheads_q, seqlen_q) float32 in natural log (O zero and LSE -inf, without
    a launch, when batch, seqlen_q or seqlen_k is 0)."""
    import torch

    target = get_target(target)
    empty = check_inputs(q, k, v, causal)
    check_no_grad(q, k, v)
    check_device(q, k, v, aligned=not empty)
    if empty:
        return empty_outputs(q, v, out, lse)
    problem = make_problem(q, k, v, causal)
    # The DSL only once the input is known to be good (its first import fixes the arch it builds for).
    _import_dsl(target)
    from cuda.bindings import driver as cuda
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import from_dlpack

    check_grid(config, problem)
    compiled = compile_forward(config, problem.dtype, problem.head_dim, problem.head_dim_v, causal, target)
    batch, seqlen_q, nheads_q, _ = q.shape
    out_shape, lse_shape = (batch, seqlen_q, nheads_q, problem.head_dim_v), (batch, nheads_q, seqlen_q)
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)
    else:
        check_output("out", out, out_shape, q.dtype, q.device)
        if any(s % 8 for s in out.stride()[:-1]):
            raise UnsupportedInput(f"out's strides {out.stride()} must be multiples of 8 elements (TMA store)")
    if lse is None:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    else:
        check_output("lse", lse, lse_shape, torch.float32, q.device, align=4)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(problem.head_dim)
    # The host function launches on the current device, and the counter is that device's current
    # stream's: both must be the tensors' device. So must the current device be when torch exports a
    # tensor through DLPack (torch 2.11 refuses a tensor of another device).
    with torch.cuda.device(q.device):
        tensors = [from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=3) for t in (q, k, v, out)]
        lse_t = from_dlpack(lse, assumed_align=4).mark_layout_dynamic(leading_dim=2)
        stream_handle = torch.cuda.current_stream(q.device).cuda_stream
        counter = from_dlpack(launch_counter(config, causal, q.device), assumed_align=4)
        compiled.function(*tensors, lse_t, counter, Float32(scale * math.log2(math.e)),
                          Int32(heads_per_l2_group(problem, target)), cuda.CUstream(stream_handle))
    return out, lse
