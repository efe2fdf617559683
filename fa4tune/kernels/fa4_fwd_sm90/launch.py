"""Running the forward kernel on torch tensors: `attention_forward` (converts its tensors on every
call: the measuring worker's and the benchmarks' way in) and the prepared launch that
`fa4tune.attention` keeps per call signature (descriptors packed once; a call writes the pointers
and the stream, allocates O and LSE, and launches)."""

from __future__ import annotations

import ctypes
import math
import threading

from ...errors import UnsupportedInput
from ...problem import Problem
from ...target import Target, get_target
from ..common.dsl import import_dsl
from ..common.inputs import (
    batch_output_shapes,
    check_device,
    check_inputs,
    check_no_grad,
    empty_outputs,
    launch_outputs,
    make_problem,
)
from ..common.launch import (
    contiguous_strides,
    direct_call,
    launch_error,
    pack_descriptor,
    raw_stream_getter,
    repack_descriptor,
)
from ..common.streams import (
    current_device_getter,
    current_split_counts,
    current_tile_counter,
    unused_counter,
)
from ..common.varlen import (
    Ragged,
    check_varlen_device,
    check_varlen_inputs,
    output_shapes,
    packed_output_shapes,
)
from ..common.varlen import make_problem as make_varlen_problem
from .compile import compile_combine, compile_forward, layout_of, pack_group_of
from .config import FwdConfig, grid_reasons, tile_count


def partial_shapes(problem: Problem, config: FwdConfig) -> tuple[tuple, tuple]:
    """The split kernel's fp32 partials: O (splits, batch, seqlen_q, nheads_q, head_dim_v) and LSE
    (splits, batch, nheads_q, seqlen_q). They are allocated per call, both in one block of torch's
    caching allocator (partial_span), which hands the same block back to the next call of the same
    shape on the stream: reuse without a buffer kept per stream and per CUDA graph (a buffer kept
    from torch.compile's CUDA-graph warm-up is one torch refuses, as the tile counters were)."""
    s, b, q, h = config.num_splits, problem.batch, problem.seqlen_q, problem.nheads_q
    if problem.total_q is not None:  # varlen Q: one batch of all rows
        b, q = 1, problem.total_q
    return _partials(s, b, q, h, problem.head_dim_v)


def _partials(splits: int, batch: int, seqlen_q: int, heads: int, head_dim_v: int):
    return (splits, batch, seqlen_q, heads, head_dim_v), (splits, batch, heads, seqlen_q)


def partial_span(shapes: tuple[tuple, tuple]) -> tuple[int, int]:
    """Both fp32 partials in one allocation (one call into the caching allocator a launch, not
    two): (where the LSE partial starts, in elements, 16-byte aligned after O's; the elements of
    the whole)."""
    o_shape, l_shape = shapes
    at = -(-math.prod(o_shape) // 4) * 4
    return at, at + math.prod(l_shape)


def allocate_partials(shapes: tuple[tuple, tuple], device):
    """The two partials as views of one allocation (partial_span)."""
    import torch

    at, total = partial_span(shapes)
    buffer = torch.empty(total, dtype=torch.float32, device=device)
    o_shape, l_shape = shapes
    return buffer[: math.prod(o_shape)].view(o_shape), buffer[at:].view(l_shape)


def combine_views(out, lse, problem: Problem):
    """O and LSE as the combine kernel writes them (combine_view_shapes)."""
    o_shape, l_shape = combine_view_shapes(out.shape, lse.shape, problem)
    return out.view(o_shape), lse.view(l_shape)


def combine_view_shapes(out_shape, lse_shape, problem: Problem) -> tuple[tuple, tuple]:
    """O's and LSE's shapes as the combine kernel writes them, (batch, seqlen_q, heads, dv) and
    (batch, heads, seqlen_q): varlen O (total_q, heads, dv) and LSE (heads, total_q) are one batch
    of all rows."""
    if problem.total_q is not None:
        return (1, *out_shape), (1, *lse_shape)
    return tuple(out_shape), tuple(lse_shape)


def heads_per_l2_group(problem: Problem, target: Target) -> int:
    """How many (batch, head) pairs to run side by side so that their K/V stay in half the L2."""
    kv_bytes = (
        problem.seqlen_k * (problem.head_dim + problem.head_dim_v) * 2 / problem.qheads_per_kvhead
    )
    fit = max(1, int((target.l2_bytes / 2) // max(kv_bytes, 1)))
    group = 1 << (fit.bit_length() - 1)
    return max(1, min(group, problem.batch * problem.nheads_q))


def launch_counter(config: FwdConfig, causal: bool, device):
    """The counter argument of one launch on torch's current stream of `device`: that stream's tile
    counter if this kernel uses it."""
    if config.uses_tile_counter(causal):
        return current_tile_counter(device)
    return unused_counter(device)


def separate_combine(config: FwdConfig) -> bool:
    """Whether a launch of `config` is followed by the combine kernel's: split, without the
    in-kernel combine."""
    return config.split and not config.combine_in_kernel


def check_grid(config: FwdConfig, problem: Problem) -> None:
    """UnsupportedInput when the config's grid cannot hold the problem (config.grid_reasons)."""
    reasons = grid_reasons(config, problem)
    if reasons:
        raise UnsupportedInput(
            f"config {config.short()} cannot launch {problem.key()}: {'; '.join(reasons)}; "
            "split the batch (or the heads)"
        )


def attention_forward(
    q,
    k,
    v,
    config: FwdConfig,
    causal: bool = False,
    softmax_scale: float | None = None,
    out=None,
    lse=None,
    target: Target | str | None = None,
):
    """Run the kernel on CUDA tensors on the current stream. Returns (out, lse): out like q with
    head_dim_v, lse (batch, nheads_q, seqlen_q) float32 in natural log (O zero and LSE -inf, without
    a launch, when batch, seqlen_q or seqlen_k is 0)."""
    import torch

    target = get_target(target)
    empty = check_inputs(q, k, v, causal)
    check_no_grad(q, k, v, "attention_forward", "fa4tune.attention")
    check_device(q, k, v, aligned=not empty)
    if empty:
        return empty_outputs(q, v, out, lse)
    problem = make_problem(q, k, v, causal)
    # The DSL only once the input is known to be good (its first import fixes the arch it builds
    # for).
    import_dsl(target)
    from cuda.bindings import driver as cuda
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import from_dlpack

    check_grid(config, problem)
    compiled = compile_forward(
        config,
        problem.dtype,
        problem.head_dim,
        problem.head_dim_v,
        causal,
        target,
        pack_group=pack_group_of(config, problem),
    )
    combine = None
    if separate_combine(config):
        combine = compile_combine(problem.dtype, problem.head_dim_v, target)
    out, lse = launch_outputs(q, out, lse, batch_output_shapes(q, v))
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(problem.head_dim)
    # The host function launches on the current device, and the counter is that device's current
    # stream's: both must be the tensors' device. So must the current device be when torch exports a
    # tensor through DLPack (torch 2.11 refuses a tensor of another device).
    with torch.cuda.device(q.device):
        tensors = [
            from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=3)
            for t in (q, k, v, out)
        ]
        lse_t = from_dlpack(lse, assumed_align=4).mark_layout_dynamic(leading_dim=2)
        stream_handle = torch.cuda.current_stream(q.device).cuda_stream
        counter = from_dlpack(launch_counter(config, causal, q.device), assumed_align=4)
        outputs = [tensors.pop(), lse_t]
        final = ()
        if config.combine_in_kernel:
            # The tiles' split counts take the counter's place; O and LSE follow the (absent)
            # ragged index tensors.
            counts = current_split_counts(q.device, tile_count(config, problem))
            counter = from_dlpack(counts, assumed_align=4).mark_layout_dynamic(leading_dim=0)
            final = (None, None, None, None, *outputs)
        if config.split:
            o_part, lse_part = allocate_partials(partial_shapes(problem, config), q.device)
            partials = [
                from_dlpack(o_part, assumed_align=16).mark_layout_dynamic(leading_dim=4),
                from_dlpack(lse_part, assumed_align=4).mark_layout_dynamic(leading_dim=3),
            ]
        compiled.function(
            *tensors,
            *(partials if config.split else outputs),
            counter,
            Float32(scale * math.log2(math.e)),
            Int32(heads_per_l2_group(problem, target)),
            cuda.CUstream(stream_handle),
            *final,
        )
        if combine is not None:
            combine(*partials, *outputs, cuda.CUstream(stream_handle))
    return out, lse


def attention_varlen_forward(
    q,
    k,
    v,
    config: FwdConfig,
    ragged: Ragged,
    causal: bool = False,
    softmax_scale: float | None = None,
    out=None,
    lse=None,
    target: Target | str | None = None,
):
    """attention_forward for ragged inputs (common/varlen.py: flash-attn-4's varlen and paged
    layouts): converts its tensors on every call (the measuring worker's and the benchmarks' way
    in). Returns (out, lse) in flash-attn-4's varlen shapes; `out` and `lse` given are written."""
    import torch

    target = get_target(target)
    empty = check_varlen_inputs(q, k, v, ragged, causal)
    check_no_grad(q, k, v, "attention_varlen_forward")
    check_varlen_device(q, k, v, ragged, aligned=not empty)
    shapes = output_shapes(q, v, ragged)
    if empty:
        return empty_outputs(q, v, out, lse, shapes)
    out, lse = launch_outputs(q, out, lse, shapes)
    problem = make_varlen_problem(q, k, v, ragged, causal)
    import_dsl(target)
    from cuda.bindings import driver as cuda
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import from_dlpack

    check_grid(config, problem)
    compiled = compile_forward(
        config,
        problem.dtype,
        problem.head_dim,
        problem.head_dim_v,
        causal,
        target,
        pack_group=pack_group_of(config, problem),
        layout=layout_of(problem),
    )
    combine = None
    if separate_combine(config):
        combine = compile_combine(problem.dtype, problem.head_dim_v, target)
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(problem.head_dim)

    def dynamic(t, align):
        return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)

    with torch.cuda.device(q.device):
        stream = cuda.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
        counter = from_dlpack(launch_counter(config, causal, q.device), assumed_align=4)
        outputs = [dynamic(out, 16), dynamic(lse, 4)]
        index = [dynamic(t, 4) for t in ragged.tensors()]
        final = []
        if config.combine_in_kernel:
            # As attention_forward's (batch-shaped Q: config.combine_reasons); the index tensors
            # in their slots, None where absent, so that O and LSE come after all four.
            counts = current_split_counts(q.device, tile_count(config, problem))
            counter = from_dlpack(counts, assumed_align=4).mark_layout_dynamic(leading_dim=0)
            every = (ragged.cu_seqlens_q, ragged.cu_seqlens_k, ragged.seqused_k, ragged.page_table)
            index = [dynamic(t, 4) if t is not None else None for t in every]
            final = outputs
        if config.split:
            o_part, lse_part = allocate_partials(partial_shapes(problem, config), q.device)
            outputs = [dynamic(o_part, 16), dynamic(lse_part, 4)]
        compiled.function(
            *(dynamic(t, 16) for t in (q, k, v)),
            *outputs,
            counter,
            Float32(scale * math.log2(math.e)),
            Int32(heads_per_l2_group(problem, target)),
            stream,
            *index,
            *final,
        )
        if combine is not None:
            o_view, lse_view = combine_views(out, lse, problem)
            combine(*outputs, dynamic(o_view, 16), dynamic(lse_view, 4), stream)
    return out, lse


class PreparedLaunch:
    """The packed arguments of one (shapes, strides, dtypes, device, causal, scale) and the compiled
    host function. A call rewrites the data pointers and the stream, and launches."""

    def __init__(
        self, problem: Problem, config, target, q, k, v, softmax_scale, ragged: Ragged | None = None
    ) -> None:
        import torch

        self.problem, self.config = problem, config
        self.device = q.device
        self.device_index = q.device.index if q.device.index is not None else 0
        self.dtype = q.dtype
        self.split = config.split
        # combine_in_kernel: one launch; the tiles' split counts take the tile counter's place.
        self.combine_in_kernel = config.combine_in_kernel
        self.tiles = tile_count(config, problem)
        # Packed rows (varlen q or k): the launch serves every call of its signature, whose row
        # totals may differ (the dispatcher keys them by power of two); a call with other totals
        # repacks the extents that follow them (_fit).
        self.varlen_q = ragged is not None and ragged.varlen_q
        self.varlen_k = ragged is not None and ragged.varlen_k
        self.rows = (q.shape[0], k.shape[0])
        self.tensor_shapes = [tuple(t.shape) for t in (q, k, v)]
        self.tensor_strides = [tuple(t.stride()) for t in (q, k, v)]
        self.out_shape, self.lse_shape = (
            batch_output_shapes(q, v) if ragged is None else output_shapes(q, v, ragged)
        )
        self.partial_shapes = partial_shapes(problem, config) if self.split else None
        self.partial_span = partial_span(self.partial_shapes) if self.split else None
        # Split-KV: the kernel writes the partials and the combine kernel reads them into O and
        # LSE; the combine's arguments are packed here too. With the in-kernel combine the kernel
        # takes O and LSE itself, after the index tensors (`final`).
        kernel_shapes, combine_shapes = self._descriptor_shapes()
        self.descriptors = [pack_descriptor(*shape) for shape in kernel_shapes]
        combine = [pack_descriptor(*shape) for shape in combine_shapes]
        if self.combine_in_kernel:  # the split counts, (tiles,) of dynamic layout
            self.descriptors.append(pack_descriptor((self.tiles,), (1,)))
        else:
            self.descriptors.append(ctypes.create_string_buffer(8))  # the tile counter
        self.final_descriptors = [
            pack_descriptor(shape, contiguous_strides(shape))
            for shape in ((self.out_shape, self.lse_shape) if self.combine_in_kernel else ())
        ]
        self.final_pointers = [ctypes.c_uint64.from_buffer(d) for d in self.final_descriptors]
        self.combine_descriptors = combine
        self.combine_pointers = [ctypes.c_uint64.from_buffer(d) for d in combine]
        # The first 8 bytes of each descriptor are its data pointer: the only part a call changes.
        self.pointers = [ctypes.c_uint64.from_buffer(d) for d in self.descriptors]
        # Kernels that ignore the tile counter get one fixed dummy: no per-call lookup or
        # allocation.
        self._tile_counter = (
            current_tile_counter if config.uses_tile_counter(problem.causal) else None
        )
        self._split_counts = current_split_counts
        self._unused_counter = None
        if self._tile_counter is None and not self.combine_in_kernel:
            self._unused_counter = unused_counter(q.device)
        scale = (
            float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(problem.head_dim)
        )
        self.scale_log2 = ctypes.c_float(scale * math.log2(math.e))
        self.l2_group = ctypes.c_int32(heads_per_l2_group(problem, target))
        self.stream = ctypes.c_void_p(0)
        # Ragged inputs: the index tensors' descriptors, after the stream (the host function's
        # argument order); their pointers too are written per call.
        self.index_descriptors = [
            pack_descriptor(t.shape, t.stride()) for t in (ragged.tensors() if ragged else ())
        ]
        self.index_pointers = [ctypes.c_uint64.from_buffer(d) for d in self.index_descriptors]
        # The compiled host function's arguments: one pointer per kernel argument, in order.
        self.arguments = (
            [ctypes.addressof(d) for d in self.descriptors]
            + [
                ctypes.addressof(self.scale_log2),
                ctypes.addressof(self.l2_group),
                ctypes.addressof(self.stream),
            ]
            + [ctypes.addressof(d) for d in self.index_descriptors]
            + [ctypes.addressof(d) for d in self.final_descriptors]
        )
        self.combine_arguments = [ctypes.addressof(d) for d in combine] + (
            [ctypes.addressof(self.stream)] if combine else []
        )
        self.lock = threading.Lock()
        self._get_device = current_device_getter()
        self._device_guard = torch.cuda.device
        self._raw_stream = raw_stream_getter()
        self._empty = torch.empty
        self._float32 = torch.float32
        self._run = self._run_combine = None

    def _descriptor_shapes(self) -> tuple[list, list]:
        """(shape, strides) of the kernel's tensor arguments before its tile counter (q, k, v, then
        O and LSE or the partials) and of the combine kernel's (the partials, O and LSE as it views
        them: varlen O and LSE as one batch of all rows)."""
        kernel = list(zip(self.tensor_shapes, self.tensor_strides))
        combine = []
        if self.split:
            for shape in self.partial_shapes:
                kernel.append((shape, contiguous_strides(shape)))
                combine.append((shape, contiguous_strides(shape)))
            views = combine_view_shapes(self.out_shape, self.lse_shape, self.problem)
            combine += [(shape, contiguous_strides(shape)) for shape in views]
            if self.combine_in_kernel:
                combine = []
        else:
            outputs = (self.out_shape, self.lse_shape)
            kernel += [(shape, contiguous_strides(shape)) for shape in outputs]
        return kernel, combine

    def _fit(self, rows: tuple[int, int]) -> None:
        """Repack the extents that follow the packed rows of q (total_q) or of k and v (total_k)
        for a call with other totals (the caller holds the lock)."""
        total_q, total_k = rows
        if self.varlen_q:
            self.tensor_shapes[0] = (total_q, *self.tensor_shapes[0][1:])
            nheads_q = self.tensor_shapes[0][1]
            self.out_shape, self.lse_shape = packed_output_shapes(
                total_q, nheads_q, self.out_shape[-1]
            )
            if self.split:
                splits, _, _, _, dv = self.partial_shapes[0]
                self.partial_shapes = _partials(splits, 1, total_q, nheads_q, dv)
                self.partial_span = partial_span(self.partial_shapes)
        if self.varlen_k:
            for i in (1, 2):
                self.tensor_shapes[i] = (total_k, *self.tensor_shapes[i][1:])
        kernel_shapes, combine_shapes = self._descriptor_shapes()
        for buffer, shape in zip(self.descriptors, kernel_shapes):
            repack_descriptor(buffer, *shape)
        for buffer, shape in zip(self.combine_descriptors, combine_shapes):
            repack_descriptor(buffer, *shape)
        self.rows = rows

    def bind(self, executor, combine=None) -> None:
        """Launch through `executor` (the compiled function bound to this launch's device), and
        with split-KV `combine` after it (the combine kernel's, bound alike)."""
        self.executor = executor
        self._run, self.result = direct_call(executor, self.arguments)
        if self.split and not self.combine_in_kernel:
            self.combine_executor = combine
            self._run_combine, self.combine_result = direct_call(combine, self.combine_arguments)

    def __call__(self, q, k, v, *index):
        """Launch on q, k, v (and with ragged inputs the index tensors, in Ragged.tensors' order,
        checked 4-byte aligned by the caller)."""
        q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
        if (q_ptr | k_ptr | v_ptr) & 15:
            raise UnsupportedInput(
                "q, k and v must start at 16-byte aligned addresses (for the TMA); "
                "pass a .clone() of a tensor sliced at an odd offset"
            )
        for t in index:
            if t.data_ptr() & 3:
                raise UnsupportedInput(
                    "cu_seqlens, seqused_k and page_table must start at 4-byte aligned addresses; "
                    "pass a .clone()"
                )
        # Only packed rows may differ between the calls of a signature (the dispatcher's key).
        rows = (q.shape[0], k.shape[0]) if self.varlen_q or self.varlen_k else self.rows
        if self._get_device() == self.device_index:
            return self._launch(q_ptr, k_ptr, v_ptr, rows, index)
        # The kernel launches in the current device's context, on its current stream, whose tile
        # counter the launch takes: make it the tensors' one.
        with self._device_guard(self.device_index):
            return self._launch(q_ptr, k_ptr, v_ptr, rows, index)

    def _launch(self, q_ptr: int, k_ptr: int, v_ptr: int, rows, index=()):
        if self.combine_in_kernel:
            counter = self._split_counts(self.device, self.tiles)
        elif self._tile_counter:
            counter = self._tile_counter(self.device)
        else:
            counter = self._unused_counter
        stream = self._raw_stream(self.device_index)
        # The descriptors and shapes are shared; the launch copies them before it returns.
        with self.lock:
            if rows != self.rows:
                self._fit(rows)
            out = self._empty(self.out_shape, dtype=self.dtype, device=self.device)
            lse = self._empty(self.lse_shape, dtype=self._float32, device=self.device)
            p = self.pointers
            for pointer, t in zip(self.index_pointers, index):
                pointer.value = t.data_ptr()
            p[0].value, p[1].value, p[2].value = q_ptr, k_ptr, v_ptr
            self.stream.value = stream
            if self.split:
                # Both partials in one block of the caching allocator, freed (stream-ordered) when
                # `partials` goes: the next launch of the shape on the stream gets it back.
                at, total = self.partial_span
                partials = self._empty(total, dtype=self._float32, device=self.device)
                o_part = partials.data_ptr()
                lse_part = o_part + 4 * at
                p[3].value, p[4].value = o_part, lse_part
                p[5].value = counter.data_ptr()
            if self.combine_in_kernel:
                f = self.final_pointers
                f[0].value, f[1].value = out.data_ptr(), lse.data_ptr()
                error = self._run()
            elif self.split:
                c = self.combine_pointers
                c[0].value, c[1].value = o_part, lse_part
                c[2].value, c[3].value = out.data_ptr(), lse.data_ptr()
                error = self._run() or self._run_combine()
            else:
                p[3].value, p[4].value = out.data_ptr(), lse.data_ptr()
                p[5].value = counter.data_ptr()
                error = self._run()
        if error:
            raise launch_error(error)
        return out, lse


def problem_device(q) -> int:
    return q.device.index if q.device.index is not None else 0


def prepare_launch(
    problem: Problem,
    config: FwdConfig,
    target: Target,
    q,
    k,
    v,
    softmax_scale,
    ragged: Ragged | None = None,
) -> PreparedLaunch:
    """The prepared launch of `config` for calls shaped like q, k, v (and `ragged`'s index
    tensors: common/varlen.py), checked by the caller."""
    check_grid(config, problem)  # a default's: the lookup skips borrowed configs that cannot launch
    compiled = compile_forward(
        config,
        problem.dtype,
        problem.head_dim,
        problem.head_dim_v,
        problem.causal,
        target,
        pack_group=pack_group_of(config, problem),
        layout=layout_of(problem),
    )
    combine = None
    if separate_combine(config):
        combine = compile_combine(problem.dtype, problem.head_dim_v, target).to(problem_device(q))
    launch = PreparedLaunch(problem, config, target, q, k, v, softmax_scale, ragged)
    # An executor for the tensors' device (the CUDA-dialect one cute.compile gives here loads a
    # context-free library and ignores it; the host function launches on the current device).
    launch.bind(compiled.function.to(launch.device_index), combine)
    return launch
