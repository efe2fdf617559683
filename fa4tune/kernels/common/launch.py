"""Prepared launches: a compiled CuTe DSL host function called with argument descriptors packed
once per call signature, so that a later call only writes the new data pointers and the stream into
them. Shared by every family's torch entry.

The DSL's `run_compiled_program` converts the argument list into a new pointer array on every call;
here the array is built once, as the DSL builds it."""

from __future__ import annotations

import ctypes
import struct

# A compiled host function takes each tensor of dynamic layout as a memref descriptor: the data
# pointer, i32 extents and the i64 strides of every mode but the last (which is 1). A tensor of
# static layout (a (1,) tile counter, say) is the pointer alone.
DESCRIPTOR_5D = struct.Struct("<Q5i4x4q")
DESCRIPTOR_4D = struct.Struct("<Q4i3q")
DESCRIPTOR_3D = struct.Struct("<Q3i4x2q")
DESCRIPTOR_2D = struct.Struct("<Q2iq")  # a page table
DESCRIPTOR_1D = struct.Struct("<Qi4x")  # cu_seqlens, seqused_k
_DESCRIPTORS = {
    1: DESCRIPTOR_1D,
    2: DESCRIPTOR_2D,
    3: DESCRIPTOR_3D,
    4: DESCRIPTOR_4D,
    5: DESCRIPTOR_5D,
}


def raw_stream_getter():
    """A function device_index -> the current stream's handle. torch's raw getter (what Triton's
    launcher uses) returns the handle as an int without building a Stream object; builds without it
    go through torch.cuda.current_stream."""
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw
    return lambda index: torch.cuda.current_stream(index).cuda_stream


def direct_call(executor, arguments: list[int]):
    """(run, result): `run()` calls the executor's compiled host function with `arguments`
    (addresses) and returns its CUDA error code (0: launched).

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
    extra = ([ctypes.addressof(result)] if result is not None else []) + [
        p.value for p in kernel_ptrs
    ]
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
    buffer = ctypes.create_string_buffer(_DESCRIPTORS[len(shape)].size)
    repack_descriptor(buffer, shape, strides)
    return buffer


def repack_descriptor(buffer: ctypes.Array, shape, strides) -> None:
    """Write another shape and strides of the same rank into a packed descriptor (its data pointer
    left 0: a launch writes it)."""
    _DESCRIPTORS[len(shape)].pack_into(buffer, 0, 0, *shape, *strides[:-1])


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of `shape` (as torch gives them)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
