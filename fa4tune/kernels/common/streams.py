"""Per-stream tile counters: a persistent kernel whose CTAs take their tiles from a global counter
needs the counter at zero when it starts and leaves it at zero when it ends, so launches that could
overlap must not share one. Each stream gets its own; a stream that captures a CUDA graph gets a new
one per call. Shared by every family whose kernels schedule tiles through a counter."""

from __future__ import annotations

import threading

_COUNTERS: dict = {}
_COUNTERS_LOCK = threading.Lock()


class _StreamQueries:
    """The two driver queries tile_counter makes per call: is the stream capturing a graph, and its
    unique id (the launch paths ask torch instead, except for external streams:
    current_tile_counter). Called through ctypes on libcuda, the cuda-python bindings where libcuda
    cannot be opened that way (which cost a few microseconds more per call on the H200's host;
    README, Dispatch)."""

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
        """What the driver function `name` writes for `stream`; RuntimeError on a driver error."""
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
        return (
            self._query("cuStreamIsCapturing", stream, self.ctypes.c_int) != 0
        )  # 0: CU_STREAM_CAPTURE_STATUS_NONE


_QUERIES: list = []


def _queries() -> _StreamQueries:
    if not _QUERIES:
        _QUERIES.append(_StreamQueries())
    return _QUERIES[0]


def _stream_key(device, stream: int) -> tuple:
    """(device, the driver's unique id of the stream): unlike a handle, the id of a destroyed stream
    is never given to a new one, so a new stream cannot inherit a counter that old work still
    uses."""
    return device, _queries().stream_id(stream)


def _capturing(stream: int) -> bool:
    return _queries().capturing(stream)


def _indexed(device):
    """`device` as a torch.device with its index ("cuda" alone: the current device)."""
    import torch

    if isinstance(device, torch.device) and device.index is not None:
        return device
    device = torch.device(device)
    return (
        device
        if device.index is not None
        else torch.device(device.type, torch.cuda.current_device())
    )


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
    return _cached(
        _COUNTERS, _stream_key(device, stream), lambda: _zeroed_counter(device, kept=True)
    )


_UNUSED: dict = {}


def unused_counter(device):
    """What a kernel that ignores the tile counter is given for it (it has the argument all the
    same): one int32 per device, never read or written, so no allocation per call. It is left
    uninitialised, and comes from the driver (_kept_int32), never from a CUDA graph's pool."""
    device = _indexed(device)
    return _cached(_UNUSED, device, lambda: _kept_int32(device))


_TORCH_STREAMS: list = []


def _torch_streams():
    """torch's C functions for the current device and stream: (the current device's index, is its
    current stream capturing, (the torch id, device index, device type) of device i's current
    stream, that stream's handle); None where this torch lacks one of them."""
    if not _TORCH_STREAMS:
        import torch

        names = (
            "_cuda_isCurrentStreamCapturing",
            "_cuda_getCurrentStream",
            "_cuda_getCurrentRawStream",
        )
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
    index = getattr(
        device, "index", None
    )  # a torch.device's; per call, so no import and no _indexed
    if torch_streams is None or not isinstance(index, int) or torch_streams[0]() != index:
        device = _indexed(device)
        return tile_counter(device, _current_handle(device))
    _, capturing, current_stream, raw_stream = torch_streams
    if capturing():
        return _zeroed_counter(device)
    torch_id = current_stream(index)[0]
    handle = raw_stream(index)
    if handle and (
        torch_id == handle or not torch_id & 1
    ):  # native ids are odd, external ones the handle
        return tile_counter(device, handle)
    key = (device, "torch", torch_id)
    counter = _COUNTERS.get(key)  # (not `or`: a tensor's truth would read it back from the GPU)
    return (
        counter
        if counter is not None
        else _cached(_COUNTERS, key, lambda: _zeroed_counter(device, kept=True))
    )


def _current_handle(device) -> int:
    import torch

    return torch.cuda.current_stream(device).cuda_stream


def _zeroed_counter(device, kept: bool = False):
    """A (1,) int32 counter at zero (zeroed on the current stream). A `kept` one (a stream's, kept
    for the process) comes from the driver; one per call during a capture from torch's allocator,
    which gives the graph's pool: freed after the call, as any temporary of a captured graph."""
    import torch

    if kept:
        return _kept_int32(device).zero_()
    return torch.zeros(1, dtype=torch.int32, device=device)


class _DriverWord:
    """`count` int32 (4 bytes each) of device memory from cuMemAlloc, never freed, shown to torch
    through the CUDA array interface."""

    def __init__(self, device, count: int = 1) -> None:
        import torch
        from cuda.bindings import driver as cuda

        with torch.cuda.device(device):  # the device's primary context, made current by torch
            torch.cuda.init()
            err, pointer = cuda.cuMemAlloc(4 * count)
        if int(err):
            raise RuntimeError(f"cuMemAlloc of a tile counter on {device} failed: {err}")
        self.pointer = pointer  # held: the memory lives as long as this object, and is not freed
        self.__cuda_array_interface__ = {
            "shape": (count,),
            "typestr": "<i4",
            "data": (int(pointer), False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def _kept_int32(device, count: int = 1):
    """A (1,) int32 tensor on `device` that the process keeps, from the driver rather than torch's
    caching allocator. Made during the first call of a kernel, that call may be part of
    torch.compile's CUDA-graph warm-up, whose allocations come from the graph's pool; a tensor kept
    there past the recording is one that torch refuses ("not tracked as outputs")."""
    import torch

    return torch.as_tensor(_DriverWord(device, count), device=device)


_SPLIT_COUNTS: dict = {}


def current_split_counts(device, count: int):
    """The in-kernel combine's split counts (one int32 per tile, zero between launches: the last
    split CTA of a tile puts its count back) for a launch of `count` tiles on torch's current
    stream of `device`, under the tile counter's rules and by its keys (current_tile_counter):
    launches that could overlap must not share them, so each stream has its own, from the driver
    and zeroed once, and while the stream captures a CUDA graph every call gets new ones, zeroed
    inside the graph (the kernel leaves them at zero, so a replay needs no host work). A stream's
    grow to the next power of two when a launch has more tiles; the old ones are kept, not freed,
    as work queued before on the stream may still use them. A prepared launch's count is fixed by
    its shapes."""
    import torch

    torch_streams = _TORCH_STREAMS[0] if _TORCH_STREAMS else _torch_streams()
    index = getattr(device, "index", None)
    key = None
    if torch_streams is not None and isinstance(index, int) and torch_streams[0]() == index:
        _, capturing, current_stream, raw_stream = torch_streams
        if capturing():
            return torch.zeros(count, dtype=torch.int32, device=device)
        torch_id = current_stream(index)[0]
        handle = raw_stream(index)
        if not (handle and (torch_id == handle or not torch_id & 1)):
            key = (device, "torch", torch_id)
    if key is None:  # an external stream, or no torch function to ask: the driver's id
        device = _indexed(device)
        with torch.cuda.device(device):
            handle = _current_handle(device)
            if _capturing(handle):
                return torch.zeros(count, dtype=torch.int32, device=device)
            key = _stream_key(device, handle)
    counts = _SPLIT_COUNTS.get(key)
    if counts is not None and counts.numel() >= count:
        return counts
    with _COUNTERS_LOCK:
        counts = _SPLIT_COUNTS.get(key)
        if counts is None or counts.numel() < count:
            size = 1 << max(count - 1, 0).bit_length()
            with torch.cuda.device(device):  # zeroed in order on the stream that will use them
                counts = _SPLIT_COUNTS[key] = _kept_int32(device, size).zero_()
    return counts
