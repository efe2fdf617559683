"""`fa4tune.attention(q, k, v, causal=False, softmax_scale=None) -> (out, lse)`: the forward pass with
the tuned config for the caller's shapes.

    out, lse = fa4tune.attention(q, k, v, causal=True)

q is (batch, seqlen_q, nheads_q, head_dim), k and v (batch, seqlen_k, nheads_kv, head_dim[_v]),
bfloat16 or float16 CUDA tensors on a Hopper GPU; nheads_q a multiple of nheads_kv (GQA/MQA). Like
flash-attn-4's `flash_attn.cute.flash_attn_func`, it returns the output (batch, seqlen_q, nheads_q,
head_dim_v) in q's dtype and the log-sum-exp (batch, nheads_q, seqlen_q) in float32, natural log.
The causal mask is aligned to the bottom right, as in FlashAttention. The kernel runs on the current
CUDA stream; nothing is synchronised. Inputs with nothing to compute (batch, seqlen_q or seqlen_k 0)
give O zero and LSE -inf, as in flash-attn-4, without a kernel.

The first call for a shape validates the inputs, looks the config up (fa4tune.lookup: $FA4TUNE_TABLE,
$FA4TUNE_DB, else the shipped tables), compiles it once (the kernels' compile cache) and prepares the
launch: the kernel's argument descriptors (pointer, shape, strides) are packed once, so that a later
call with the same shapes, strides, dtypes, devices, causality and scale only writes the new data
pointers and the stream into them and calls the compiled host function. `explain` says which config
a call would use, without running anything."""

from __future__ import annotations

import ctypes
import math
import numbers
import struct
import threading
import warnings

from .kernels.interface import (UnsupportedInput, check_device, check_grid,  # noqa: F401  (API)
                                check_inputs, check_no_grad, current_device_getter, empty_outputs,
                                make_problem, problem_of)
from .problem import Problem

MAX_PREPARED = 4096  # prepared launches kept; beyond it the cache starts over (shapes that never repeat)
_LAUNCHES: dict = {}
_PREPARE_LOCK = threading.Lock()

# The compiled kernel takes each tensor as a memref descriptor: data pointer, i32 extents, i64 strides
# of every mode but the last (which is 1). Four 4-D tensors (q, k, v, out) and the 3-D LSE; the tile
# counter's layout is static, (1,), so its descriptor is the pointer alone.
DESCRIPTOR_4D = struct.Struct("<Q4i3q")
DESCRIPTOR_3D = struct.Struct("<Q3i4x2q")


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None):
    """(out, lse) of softmax(scale · q kᵀ [+ causal mask]) v with the tuned kernel; see the module."""
    try:
        # get_device(): an int (-1 off the GPU), cheaper to build and hash than a torch.device; with
        # is_cuda it names the device. A causal that is not a bool (1 equals True) goes to _prepare.
        key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
               q.get_device(), k.get_device(), v.get_device(), q.is_cuda, k.is_cuda, v.is_cuda, causal,
               softmax_scale) if causal is True or causal is False else None
        if q.requires_grad or k.requires_grad or v.requires_grad:  # checked on every call, not once
            check_no_grad(q, k, v)
    except (AttributeError, RuntimeError):  # not tensors, or nested ones (no shape): _prepare says which
        key = None
    try:
        launch = _LAUNCHES.get(key)
    except TypeError:  # an unhashable causal or scale: _prepare says which
        key = launch = None
    if launch is None:
        launch = _prepare(key, q, k, v, causal, softmax_scale)
    return launch(q, k, v)


def explain(q, k, v, causal: bool = False, target=None):
    """The LookupResult (config, and which rung of the lookup it came from) that `attention` would
    use for these tensors; the tensors may be on any device (meta too) and nothing runs."""
    from .runtime import lookup

    problem = problem_of(q, k, v, causal)
    if target is None and getattr(q, "is_cuda", False):
        target = _device_target(q.device)
    return lookup(problem, target)


def clear() -> None:
    """Forget prepared launches (after changing FA4TUNE_TABLE / FA4TUNE_DB, with fa4tune.runtime.reset)."""
    with _PREPARE_LOCK:
        _LAUNCHES.clear()


# ---- validation -------------------------------------------------------------------------------------
def _device_target(device):
    """The Target of a CUDA device, or UnsupportedInput when the kernel cannot run on it."""
    import torch

    from .target import target_for_device

    props = torch.cuda.get_device_properties(device)
    name, capability = props.name, (props.major, props.minor)
    target = target_for_device(props)  # an undescribed Hopper GPU too (target.undescribed_hopper)
    if capability != (9, 0) or target is None or target.arch != "sm_90a":
        raise UnsupportedInput(f"fa4tune.attention runs on Hopper GPUs (H100, H200: sm_90a); {device} is {name} "
                               f"(compute capability {capability[0]}.{capability[1]})")
    return target


def _say_undescribed(target) -> None:
    """Warn once per model that a Hopper GPU without a description runs the default configs (from
    attention's first call for a shape; stacklevel: the caller of attention)."""
    from .target import is_described

    if is_described(target) or target.name in _UNDESCRIBED_SEEN:
        return
    _UNDESCRIBED_SEEN.add(target.name)
    warnings.warn(f"fa4tune.attention: {target.name} is a Hopper GPU that fa4tune has no description or tuned "
                  f"table of (it knows H100 and H200); running the kernel's default configs, sized to its "
                  f"{target.sm_count} SMs", RuntimeWarning, stacklevel=4)


_UNDESCRIBED_SEEN: set = set()


# ---- prepared launches ------------------------------------------------------------------------------
def _prepare(key, q, k, v, causal, softmax_scale) -> "_Launch | _Empty":
    empty = check_inputs(q, k, v, causal)  # (attention() has checked requires_grad already)
    # Any real number (a numpy float too), not a bool; a tensor would cost a device sync per call.
    if softmax_scale is not None and not (isinstance(softmax_scale, numbers.Real)
                                          and not isinstance(softmax_scale, bool)
                                          and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise UnsupportedInput(f"softmax_scale must be a positive finite number or None (a Python or numpy "
                               f"number, not a tensor or bool), got {softmax_scale!r}")
    check_device(q, k, v, aligned=not empty)  # nothing is read from empty inputs
    target = _device_target(q.device)  # empty inputs too: whether a call is refused does not depend on sizes
    if empty:
        launch = _Empty()
        with _PREPARE_LOCK:
            _remember(key, launch)
        return launch
    problem = make_problem(q, k, v, causal)
    _say_undescribed(target)
    from .kernels.interface import compile_forward
    from .runtime import lookup

    config = lookup(problem, target).config
    check_grid(config, problem)  # a default's: the lookup skips borrowed configs that cannot launch
    with _PREPARE_LOCK:
        launch = _LAUNCHES.get(key) if key is not None else None
        if launch is None:
            compiled = compile_forward(config, problem.dtype, problem.head_dim, problem.head_dim_v, causal, target)
            launch = _Launch(problem, config, target, q, k, v, softmax_scale)
            # An executor for the tensors' device (the CUDA-dialect one cute.compile gives here loads
            # a context-free library and ignores it; the host function launches on the current device).
            launch.bind(compiled.function.to(launch.device_index))
            _remember(key, launch)
    return launch


def _remember(key, launch) -> None:
    """Keep a prepared launch for its key (the caller holds _PREPARE_LOCK)."""
    if key is not None:
        if len(_LAUNCHES) >= MAX_PREPARED:
            _LAUNCHES.clear()
        _LAUNCHES[key] = launch


def _raw_stream_getter():
    """A function device_index -> the current stream's handle. torch's raw getter (what Triton's
    launcher uses) returns the handle as an int without building a Stream object; builds without it
    go through torch.cuda.current_stream."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


class _Empty:
    """Inputs with nothing to compute (no batch, query rows or keys): O zero and LSE -inf on the
    tensors' device and its current stream, without a kernel."""

    def __call__(self, q, k, v):
        import torch

        with torch.cuda.device(q.device):
            return empty_outputs(q, v)


class _Launch:
    """The packed arguments of one (shapes, strides, dtypes, device, causal, scale) and the compiled
    host function. A call rewrites the data pointers and the stream, and launches."""

    def __init__(self, problem: Problem, config, target, q, k, v, softmax_scale) -> None:
        import torch

        from .kernels.interface import current_tile_counter, heads_per_l2_group, unused_counter

        self.problem, self.config = problem, config
        self.device = q.device
        self.device_index = q.device.index if q.device.index is not None else 0
        self.dtype = q.dtype
        self.out_shape = (problem.batch, problem.seqlen_q, problem.nheads_q, problem.head_dim_v)
        self.lse_shape = (problem.batch, problem.nheads_q, problem.seqlen_q)
        out_strides = torch.empty(self.out_shape, device="meta").stride()
        lse_strides = torch.empty(self.lse_shape, device="meta").stride()
        self.descriptors = [pack_descriptor(t.shape, t.stride()) for t in (q, k, v)]
        self.descriptors.append(pack_descriptor(self.out_shape, out_strides))
        self.descriptors.append(pack_descriptor(self.lse_shape, lse_strides))
        self.descriptors.append(ctypes.create_string_buffer(8))  # the tile counter
        # The first 8 bytes of each descriptor are its data pointer: the only part a call changes.
        self.pointers = [ctypes.c_uint64.from_buffer(d) for d in self.descriptors]
        # Kernels that ignore the tile counter get one fixed dummy: no per-call lookup or allocation.
        self._tile_counter = current_tile_counter if config.uses_tile_counter(problem.causal) else None
        self._unused_counter = unused_counter(q.device) if self._tile_counter is None else None
        scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(problem.head_dim)
        self.scale_log2 = ctypes.c_float(scale * math.log2(math.e))
        self.l2_group = ctypes.c_int32(heads_per_l2_group(problem, target))
        self.stream = ctypes.c_void_p(0)
        # The compiled host function's arguments: one pointer per kernel argument, in order.
        self.arguments = [ctypes.addressof(d) for d in self.descriptors] + [
            ctypes.addressof(self.scale_log2), ctypes.addressof(self.l2_group), ctypes.addressof(self.stream)]
        self.lock = threading.Lock()
        self._get_device = current_device_getter()
        self._device_guard = torch.cuda.device
        self._raw_stream = _raw_stream_getter()
        self._empty = torch.empty
        self._float32 = torch.float32
        self._run = None

    def bind(self, executor) -> None:
        """Launch through `executor` (the compiled function bound to this launch's device)."""
        self.executor = executor
        self._run, self.result = direct_call(executor, self.arguments)

    def __call__(self, q, k, v):
        q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (q_ptr | k_ptr | v_ptr) & 15:
            raise UnsupportedInput("q, k and v must start at 16-byte aligned addresses (for the TMA); "
                                   "pass a .clone() of a tensor sliced at an odd offset")
        if self._get_device() == self.device_index:
            return self._launch(q_ptr, k_ptr, v_ptr)
        # The kernel launches in the current device's context, on its current stream, whose tile
        # counter the launch takes: make it the tensors' one.
        with self._device_guard(self.device_index):
            return self._launch(q_ptr, k_ptr, v_ptr)

    def _launch(self, q_ptr: int, k_ptr: int, v_ptr: int):
        out = self._empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = self._empty(self.lse_shape, dtype=self._float32, device=self.device)
        counter = self._tile_counter(self.device) if self._tile_counter else self._unused_counter
        stream = self._raw_stream(self.device_index)
        with self.lock:  # the descriptors are shared; the launch copies them before it returns
            p = self.pointers
            p[0].value, p[1].value, p[2].value = q_ptr, k_ptr, v_ptr
            p[3].value, p[4].value, p[5].value = out.data_ptr(), lse.data_ptr(), counter.data_ptr()
            self.stream.value = stream
            error = self._run()
        if error:
            raise launch_error(error)
        return out, lse


def direct_call(executor, arguments: list[int]):
    """(run, result): `run()` calls the executor's compiled host function with `arguments` (addresses)
    and returns its CUDA error code (0: launched).

    The DSL's `run_compiled_program` converts the argument list into a new pointer array on every
    call; here the array is built once, as the DSL builds it (the arguments, then the address of the
    error code the host function writes, then the kernels' function handles), with an error slot of
    this launch's own. An executor without that layout falls back to `run_compiled_program`."""
    try:
        capi = executor.capi_func
        kernel_ptrs = list(executor._kernel_ptrs or ())
        result_type = type(executor.cuda_result) if executor._has_cuda_result else None
    except AttributeError:
        result_type = capi = None
    if capi is None:
        def run():
            executor.run_compiled_program(arguments)
            return 0
        return run, None
    result = result_type() if result_type is not None else None
    extra = ([ctypes.addressof(result)] if result is not None else []) + [p.value for p in kernel_ptrs]
    packed = (ctypes.c_void_p * (len(arguments) + len(extra)))(*arguments, *extra)
    if result is None:
        def run():
            capi(packed)
            return 0
        return run, None

    def run():
        capi(packed)
        return result.value
    return run, result


def launch_error(code: int) -> RuntimeError:
    """The exception of a launch whose host function returned CUDA error `code`."""
    try:
        from cuda.bindings import runtime as cudart

        name = cudart.cudaGetErrorName(cudart.cudaError_t(code))[1].decode()
    except Exception:  # noqa: BLE001  (an unknown code: the number says it)
        name = "unknown CUDA error"
    return RuntimeError(f"the fa4tune kernel launch failed: {name} ({code})")


def pack_descriptor(shape, strides) -> ctypes.Array:
    """A tensor's descriptor as the compiled kernel reads it (data pointer left 0)."""
    layout = DESCRIPTOR_4D if len(shape) == 4 else DESCRIPTOR_3D
    buffer = ctypes.create_string_buffer(layout.size)
    layout.pack_into(buffer, 0, 0, *shape, *strides[:-1])
    return buffer
