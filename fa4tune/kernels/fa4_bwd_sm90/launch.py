"""Running the backward kernel on torch tensors: `attention_backward(dout, q, k, v, out, lse,
config)` -> (dq, dk, dv).

Around the kernel: the preprocessing kernel writes LSE2 = LSE x log2(e) (+inf where a row saw no
key, so that its P is 0) and D = softmax_scale x rowsum(dO * O) in fp32, both padded to whole Q
blocks (their TMA rows must start 16-byte aligned), and zeroes the fp32 dQ accumulator; after the
kernel torch casts the accumulator to dQ in q's dtype (dq_flat: the cast kernel of postprocess.py,
the accumulator's values in the main kernel's fragment order). dK and dV are written by the
kernel. With a gradient of the LSE (`dlse`, fa4tune.attention returns the LSE), dS gains P x dlse:
it enters as D - dlse."""

from __future__ import annotations

import math

from ...errors import UnsupportedInput
from ...target import Target, get_target
from ..common.dsl import import_dsl
from ..common.inputs import check_device, check_inputs, make_problem
from ..common.streams import current_tile_counter
from .compile import compile_backward, compile_postprocess, compile_preprocess
from .config import BwdConfig, flat_slab, grid_reasons, head_dim_chunk

LOG2_E = math.log2(math.e)


def check_gradient_inputs(dout, q, k, v, out, lse, dlse=None) -> None:
    """What the backward takes beyond q, k, v (check_inputs): dout and out like q with head_dim_v,
    in q's dtype and on q's device, 16-byte aligned with strides of multiples of 8 elements; lse
    (batch, nheads_q, seqlen_q) fp32; dlse None or like lse."""
    import torch

    batch, seqlen_q, nheads_q, _ = q.shape
    o_shape = (batch, seqlen_q, nheads_q, v.shape[3])
    for name, t in (("dout", dout), ("out", out)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != o_shape or t.dtype != q.dtype:
            raise UnsupportedInput(
                f"{name} must be {o_shape} {q.dtype}; it is "
                f"{tuple(getattr(t, 'shape', ()))} {getattr(t, 'dtype', type(t).__name__)}"
            )
        if t.device != q.device:
            raise UnsupportedInput(f"{name} must be on {q.device}, not {t.device}")
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is None and name == "dlse":
            continue
        shape = (batch, nheads_q, seqlen_q)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != torch.float32:
            raise UnsupportedInput(
                f"{name} must be {shape} float32; it is {tuple(getattr(t, 'shape', ()))} "
                f"{getattr(t, 'dtype', type(t).__name__)}"
            )
        if t.device != q.device:
            raise UnsupportedInput(f"{name} must be on {q.device}, not {t.device}")


def heads_per_section(problem, config: BwdConfig, target: Target) -> int:
    """K/V heads of one batch whose CTAs the kernel runs side by side, each K block of all of them
    before the next K block (kernel.cta_coords). Causal, so that the longest walks (K block 0's)
    start first: the most heads whose current query head's Q, dO and fp32 dQ rows (what a K/V
    head's CTAs share) fit in half the L2, a power of two that divides the K/V heads (the grid's
    sections are whole). Otherwise 1, the grid's order: without a mask every CTA walks as far, and
    the deterministic mode's adds follow their launch (kernel.launch_order)."""
    if not problem.causal or config.deterministic:
        return 1
    d, dv = problem.head_dim, problem.head_dim_v
    per_head = problem.seqlen_q * ((d + dv) * 2 + d * 4)
    fit = max(1, int((target.l2_bytes / 2) // per_head))
    section = 1 << (fit.bit_length() - 1)
    while problem.nheads_kv % section:
        section //= 2
    return section


def _kernel_ready(t):
    """t itself if the TMA can read it (last dim contiguous, strides multiples of 8 elements, a
    16-byte aligned start), else a contiguous copy (a gradient autograd made by expanding, say)."""
    ok = (
        t.stride(-1) == 1
        and 0 not in t.stride()
        and all(s % 8 == 0 for s in t.stride()[:-1])
        and t.data_ptr() % 16 == 0
    )
    if ok:
        return t
    return t.clone() if t.is_contiguous() else t.contiguous()


def attention_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    config: BwdConfig,
    causal: bool = False,
    softmax_scale: float | None = None,
    dlse=None,
    target: Target | str | None = None,
    grads=None,
):
    """(dq, dk, dv) of attention(q, k, v) given dout (and dlse), from the forward's out and lse, on
    the current stream. q is (batch, seqlen_q, nheads_q, d), k and v (batch, seqlen_k, nheads_kv,
    d); the gradients are like them, written into `grads` (dq, dk, dv) when given."""
    import torch

    target = get_target(target)
    empty = check_inputs(q, k, v, causal)
    check_gradient_inputs(dout, q, k, v, out, lse, dlse)
    check_device(q, k, v, aligned=not empty)
    if grads is not None:
        for name, t, like in zip(("dq", "dk", "dv"), grads, (q, k, v)):
            if (
                tuple(t.shape) != tuple(like.shape)
                or t.dtype != like.dtype
                or not t.is_contiguous()
            ):
                raise UnsupportedInput(
                    f"{name} must be a contiguous {tuple(like.shape)} {like.dtype} tensor"
                )
    if empty:
        zeros = (torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v))
        if grads is None:
            return zeros
        for t, zero in zip(grads, zeros):
            t.copy_(zero)
        return tuple(grads)
    problem = make_problem(q, k, v, causal)
    reasons = grid_reasons(problem)
    if reasons:
        raise UnsupportedInput("; ".join(reasons))
    import_dsl(target)
    compiled = compile_backward(config, problem.dtype, problem.head_dim, causal, target)
    preprocess = compile_preprocess(
        problem.dtype, problem.head_dim_v, problem.head_dim, dlse is not None, target
    )
    if dlse is not None:
        dlse = dlse.contiguous()
    batch, seqlen_q, nheads_q, d = q.shape
    tile_m = config.tile_m
    padded = -(-seqlen_q // tile_m) * tile_m
    scale = float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d)
    dout, out = _kernel_ready(dout), _kernel_ready(out)
    with torch.cuda.device(q.device):
        # LSE2 and D = scale x (rowsum(dO * O) - dLSE), rows padded to the Q tile, and dQ's
        # accumulator zeroed (preprocess.py).
        lse2 = torch.empty((batch, nheads_q, padded), device=q.device)
        dsum = torch.empty((batch, nheads_q, padded), device=q.device)
        # dq_flat: rows padded to the Q tile, the memory in the kernel's fragment order
        # (config.flat_dq_offset), read back by the cast kernel (postprocess.py)
        rows = padded if config.dq_flat else seqlen_q
        dq_acc = torch.empty((batch, rows, nheads_q, d), dtype=torch.float32, device=q.device)
        run_preprocess(preprocess, dout, out, lse.contiguous(), dlse, lse2, dsum, dq_acc, scale)
        dk, dv = (torch.empty_like(k), torch.empty_like(v)) if grads is None else grads[1:]
        semaphore = None
        if config.deterministic:  # a turn count per Q block and chunk of the head dim
            blocks = padded // tile_m * (d // head_dim_chunk(d))
            semaphore = torch.zeros((batch, nheads_q, blocks), dtype=torch.int32, device=q.device)

        # persistent causal: the walks' counter, the stream's (zero, and left at zero)
        counter = current_tile_counter(q.device) if config.persistent and problem.causal else None
        run_kernel(
            compiled,
            (q, k, v, dout, lse2, dsum, dq_acc, dk, dv),
            semaphore,
            counter,
            scale,
            heads_per_section(problem, config, target),
        )
        # dS carries the softmax scale, so the accumulator holds dQ itself: a plain cast (dq_flat:
        # the cast kernel, which puts the values back in place).
        dq = grads[0] if grads is not None else None
        if dq is None:
            dq = torch.empty((batch, seqlen_q, nheads_q, d), dtype=q.dtype, device=q.device)
        if config.dq_flat:
            cast = compile_postprocess(problem.dtype, d, flat_slab(config, d), target)
            run_postprocess(cast, dq_acc, dq)
        else:
            dq.copy_(dq_acc)
    return dq, dk, dv


def _dynamic(t, align: int):
    """The DSL's view of a torch tensor, every extent and stride but the last run-time (detached:
    DLPack refuses tensors that require grad)."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t.detach(), assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)


def run_preprocess(function, dout, out, lse, dlse, lse2, dsum, dq_acc, scale: float) -> None:
    """Launch the preprocessing kernel on the current stream of the tensors' device (dout and out
    as _kernel_ready leaves them: their strides are multiples of 8 elements, which its 16-byte
    loads take on trust; dq_acc contiguous)."""
    import torch
    from cuda.bindings import driver as cuda
    from cutlass import Float32

    stream = cuda.CUstream(torch.cuda.current_stream(dout.device).cuda_stream)
    function(
        _dynamic(dout, 16),
        _dynamic(out, 16),
        _dynamic(lse, 4),
        _dynamic(dlse, 4) if dlse is not None else None,
        _dynamic(lse2, 16),
        _dynamic(dsum, 16),
        _dynamic(dq_acc, 16),
        Float32(scale),
        stream,
    )


def run_postprocess(function, dq_acc, dq) -> None:
    """Launch the cast of a dq_flat accumulator into dq (batch, seqlen_q, heads, head_dim; its
    last dim contiguous) on the current stream of its device. The cast's 16-byte stores want dq's
    other strides in multiples of 8 elements and its start 16-byte aligned: a dq without them
    (a caller's buffer) gets the cast through a contiguous copy."""
    import torch
    from cuda.bindings import driver as cuda

    stream = cuda.CUstream(torch.cuda.current_stream(dq.device).cuda_stream)
    if dq.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in dq.stride()[:-1]):
        function(_dynamic(dq_acc, 16), _dynamic(dq, 16), stream)
        return
    packed = torch.empty(dq.shape, dtype=dq.dtype, device=dq.device)
    function(_dynamic(dq_acc, 16), _dynamic(packed, 16), stream)
    dq.copy_(packed)


def run_kernel(compiled, tensors, semaphore, counter, scale: float, section: int = 1) -> None:
    """Launch the compiled kernel on the current stream of the tensors' device: q, k, v, dO, LSE2,
    D, the dQ accumulator, dK, dV (in that order), the semaphores or None, the walks' counter
    (persistent causal) or None."""
    import torch
    from cuda.bindings import driver as cuda
    from cutlass import Float32, Int32

    device = tensors[0].device
    stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
    compiled.function(
        *(_dynamic(t, 16) for t in tensors),
        _dynamic(semaphore, 4) if semaphore is not None else None,
        _dynamic(counter, 4) if counter is not None else None,
        Float32(scale * LOG2_E),
        Float32(scale),
        Int32(section.bit_length() - 1),  # a power of two
        stream,
    )
