"""`fa4tune.attention(q, k, v, causal=False, softmax_scale=None) -> (out, lse)`: the forward pass
with the tuned config for the caller's shapes. This module's `attention` is its eager path:
`fa4tune.attention` (fa4tune.runtime.ops) calls it directly, or through the torch op while
torch.compile or torch.export traces.

    out, lse = fa4tune.attention(q, k, v, causal=True)

q is (batch, seqlen_q, nheads_q, head_dim), k and v (batch, seqlen_k, nheads_kv, head_dim[_v]),
bfloat16 or float16 CUDA tensors on a Hopper GPU; nheads_q a multiple of nheads_kv (GQA/MQA). Like
flash-attn-4's `flash_attn.cute.flash_attn_func`, it returns the output (batch, seqlen_q, nheads_q,
head_dim_v) in q's dtype and the log-sum-exp (batch, nheads_q, seqlen_q) in float32, natural log.
The causal mask is aligned to the bottom right, as in FlashAttention. The kernel runs on the current
CUDA stream; nothing is synchronised. Inputs with nothing to compute (batch, seqlen_q or seqlen_k 0)
give O zero and LSE -inf, as in flash-attn-4, without a kernel.

The first call for a shape validates the inputs, looks the config up (fa4tune.lookup:
$FA4TUNE_TABLE, $FA4TUNE_DB, else the shipped tables), compiles it once (the kernels' compile cache)
and has the family prepare the launch: the kernel's argument descriptors (pointer, shape, strides)
are packed once, so that a later call with the same shapes, strides, dtypes, devices, causality and
scale only writes the new data pointers and the stream into them and calls the compiled host
function. `explain` says which config a call would use, without running anything."""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict

from ..errors import UnsupportedInput
from ..kernels import get_kernel, loadable_families
from ..kernels.common.inputs import (
    check_device,
    check_inputs,
    check_no_grad,
    check_scale,
    empty_outputs,
    make_problem,
    problem_of,
)
from ..kernels.common.varlen import (
    Ragged,
    check_varlen_device,
    check_varlen_inputs,
    packed_output_shapes,
)
from ..kernels.common.varlen import make_problem as make_varlen_problem
from ..target import is_described, target_for_device
from .lookup import lookup

ENTRY = "attention"  # the families that serve this function's calls (KernelFamily.entry)
BACKWARD_KERNEL = "fa4_bwd_sm90"  # the family autograd's backward runs
# Prepared launches kept; beyond it the least recently used ones go (a server's shapes that never
# repeat, or many more than it uses at once).
MAX_PREPARED = 4096


class PreparedLaunches:
    """Prepared launches by call signature, the least recently used dropped beyond `capacity`. A
    hit is a dict lookup and a move to the end (both one step under the GIL, so no lock on the hot
    path); only inserting takes _PREPARE_LOCK (the caller holds it)."""

    def __init__(self, capacity: int = MAX_PREPARED) -> None:
        self.capacity = capacity
        self.prepared = 0  # launches put in so far (a soak's count of prepares)
        self._items: OrderedDict = OrderedDict()

    def get(self, key):
        launch = self._items.get(key)
        if launch is not None:
            try:
                self._items.move_to_end(key)
            except KeyError:  # dropped by another thread in between: still a valid launch
                pass
        return launch

    def put(self, key, launch) -> None:
        self.prepared += 1
        self._items[key] = launch
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key) -> bool:
        return key in self._items

    def values(self) -> list:
        """The kept launches, least recently used first (a copy)."""
        return list(self._items.values())


_LAUNCHES = PreparedLaunches()
_PREPARE_LOCK = threading.Lock()


def attention(q, k, v, causal: bool = False, softmax_scale: float | None = None):
    """(out, lse) of softmax(scale · q kᵀ [+ causal mask]) v by the tuned kernel; see the module."""
    try:
        # get_device(): an int (-1 off the GPU), cheaper to build and hash than a torch.device; with
        # is_cuda it names the device. A causal that is not a bool (1 equals True) goes to _prepare.
        key = (
            (
                q.shape,
                k.shape,
                v.shape,
                q.stride(),
                k.stride(),
                v.stride(),
                q.dtype,
                k.dtype,
                v.dtype,
                q.get_device(),
                k.get_device(),
                v.get_device(),
                q.is_cuda,
                k.is_cuda,
                v.is_cuda,
                causal,
                softmax_scale,
            )
            if causal is True or causal is False
            else None
        )
        if q.requires_grad or k.requires_grad or v.requires_grad:  # checked on every call, not once
            check_no_grad(q, k, v, "fa4tune.runtime.dispatch.attention", "fa4tune.attention")
    except (
        AttributeError,
        RuntimeError,
    ):  # not tensors, or nested ones (no shape): _prepare says which
        key = None
    try:
        launch = _LAUNCHES.get(key)
    except TypeError:  # an unhashable causal or scale: _prepare says which
        key = launch = None
    if launch is None:
        launch = _prepare(key, q, k, v, causal, softmax_scale)
    return launch(q, k, v)


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    seqused_k=None,
    page_table=None,
    causal: bool = False,
    softmax_scale: float | None = None,
):
    """(out, lse) of attention over ragged inputs, as flash-attn-4's `flash_attn_varlen_func`:
    packed sequences (cu_seqlens_q, cu_seqlens_k), a paged KV cache (page_table), keys used per
    sequence (seqused_k); each None where that input is batch-shaped. Layouts, shapes and what is
    checked: fa4tune.kernels.common.varlen; docs/serving.md. No device sync: max_seqlen_q and
    max_seqlen_k, if given, only key the lookup."""
    index = (cu_seqlens_q, cu_seqlens_k, seqused_k, page_table)
    try:
        # Packed rows are keyed by their power of two (rows_class): one launch serves the calls
        # whose totals share it (their problems share a bucket; PreparedLaunch repacks the rows).
        key = (
            (
                "varlen",
                q.shape if cu_seqlens_q is None else (rows_class(q.shape[0]), q.shape[1:]),
                k.shape if cu_seqlens_k is None else (rows_class(k.shape[0]), k.shape[1:]),
                v.shape if cu_seqlens_k is None else (rows_class(v.shape[0]), v.shape[1:]),
                q.stride(),
                k.stride(),
                v.stride(),
                q.dtype,
                k.dtype,
                v.dtype,
                q.get_device(),
                k.get_device(),
                v.get_device(),
                q.is_cuda,
                k.is_cuda,
                v.is_cuda,
                *(
                    None if t is None else (t.shape, t.stride(), t.dtype, t.get_device(), t.is_cuda)
                    for t in index
                ),
                # The key's seqlens are these rounded up to powers of two (common/varlen.py).
                None if max_seqlen_q is None else (max_seqlen_q - 1).bit_length(),
                None if max_seqlen_k is None else (max_seqlen_k - 1).bit_length(),
                causal,
                softmax_scale,
            )
            if causal is True or causal is False
            else None
        )
        if q.requires_grad or k.requires_grad or v.requires_grad:
            check_no_grad(q, k, v, "fa4tune.attention_varlen")
    except (AttributeError, RuntimeError, TypeError):  # _prepare_varlen says what is wrong
        key = None
    try:
        launch = _LAUNCHES.get(key)
    except TypeError:
        key = launch = None
    if launch is None:
        ragged = Ragged(*index[:2], seqused_k, page_table, max_seqlen_q, max_seqlen_k)
        launch = _prepare_varlen(key, q, k, v, ragged, causal, softmax_scale)
    return launch(q, k, v, *(t for t in index if t is not None))


def rows_class(rows: int) -> int:
    """The power of two that `rows` packed rows round up to, as an exponent (0 and 1 rows each a
    class of their own: an empty call, and one row, whose strides torch need not keep)."""
    return rows if rows < 2 else (rows - 1).bit_length() + 1


def attention_backward(dout, q, k, v, out, lse, dlse=None, causal=False, softmax_scale=None):
    """(dq, dk, dv) of fa4tune.attention's call on q, k, v given dout (and dlse): the backward
    family's tuned config (its lookup; dQ's sums made deterministic while
    torch.use_deterministic_algorithms is on), the backward kernel on the current stream. The
    eager path of torch.ops.fa4tune.attention_backward, which autograd calls."""
    import torch

    from ..kernels.fa4_bwd_sm90.config import deterministic_config
    from ..kernels.fa4_bwd_sm90.launch import attention_backward as run_backward

    check_inputs(q, k, v, causal)
    check_scale(softmax_scale)
    check_device(q, k, v, aligned=False)
    target, _ = device_target(q.device)
    family = get_kernel(BACKWARD_KERNEL)
    problem = make_problem(q, k, v, causal)
    config = lookup(problem, target, kernel=family.name).config
    if torch.are_deterministic_algorithms_enabled():
        config = deterministic_config(config, problem, target)
    return run_backward(
        dout, q, k, v, out, lse, config, causal, softmax_scale, dlse=dlse, target=target
    )


def explain_varlen(
    q,
    k,
    v,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    seqused_k=None,
    page_table=None,
    causal: bool = False,
    target=None,
):
    """The LookupResult that `attention_varlen` would use for these tensors (any device, meta too);
    nothing runs."""
    ragged = Ragged(cu_seqlens_q, cu_seqlens_k, seqused_k, page_table, max_seqlen_q, max_seqlen_k)
    if check_varlen_inputs(q, k, v, ragged, causal):
        raise UnsupportedInput("empty inputs have nothing to look up or tune")
    problem = make_varlen_problem(q, k, v, ragged, causal)
    family = None
    if target is None and getattr(q, "is_cuda", False):
        target, family = device_target(q.device)
    return lookup(problem, target, kernel=family.name if family is not None else None)


def explain(q, k, v, causal: bool = False, target=None):
    """The LookupResult (config, and which rung of the lookup it came from) that `attention` would
    use for these tensors; the tensors may be on any device (meta too) and nothing runs."""
    problem = problem_of(q, k, v, causal)
    family = None
    if target is None and getattr(q, "is_cuda", False):
        target, family = device_target(q.device)
    return lookup(problem, target, kernel=family.name if family is not None else None)


def clear() -> None:
    """Forget prepared launches (after changing FA4TUNE_TABLE / FA4TUNE_DB, with
    fa4tune.runtime.reset)."""
    with _PREPARE_LOCK:
        _LAUNCHES.clear()


# ---- validation ---------------------------------------------------------------------------------
def _serving(target=None) -> list:
    """Families that serve fa4tune.attention (on `target`'s arch, when given), the default first.
    A third-party family that does not load is left out, with a warning (once), so that it stops
    only the GPUs that no other family serves; device_target's refusal then names it."""
    default = get_kernel(None)
    found, broken = loadable_families()
    for why in broken:
        if why not in _BROKEN_PLUGINS:
            _BROKEN_PLUGINS.add(why)
            warnings.warn(
                f"fa4tune.attention: {why}; running the families that load",
                RuntimeWarning,
                stacklevel=5,
            )
    ordered = [default] + [f for f in found.values() if f is not default]
    return [f for f in ordered if f.entry == ENTRY and (target is None or f.arch == target.arch)]


_BROKEN_PLUGINS: set = set()  # the errors of kernel-family plugins that did not load (warned)


def device_target(device):
    """(Target, family) of a CUDA device: its target and the family that serves attention there, or
    UnsupportedInput when none does."""
    import torch

    props = torch.cuda.get_device_properties(device)
    name, capability = props.name, (props.major, props.minor)
    target = target_for_device(props)  # an undescribed Hopper GPU too (target.undescribed_hopper)
    serving = (
        [f for f in _serving(target) if f.capability == capability] if target is not None else []
    )
    if not serving:
        where = "; ".join(dict.fromkeys(f.gpus for f in _serving()))
        broken = "".join(f" ({why})" for why in loadable_families()[1])  # might have served it
        raise UnsupportedInput(
            f"fa4tune.attention runs on {where}; {device} is {name} "
            f"(compute capability {capability[0]}.{capability[1]}){broken}"
        )
    return target, serving[0]


def _say_undescribed(target) -> None:
    """Warn once per model that a Hopper GPU without a description runs the default configs (from
    attention's first call for a shape; stacklevel: the caller of attention)."""
    if is_described(target) or target.name in _UNDESCRIBED_SEEN:
        return
    _UNDESCRIBED_SEEN.add(target.name)
    warnings.warn(
        f"fa4tune.attention: {target.name} is a Hopper GPU that fa4tune has no description or "
        "tuned table of (it knows H100 and H200); running the kernel's default configs, "
        f"sized to its {target.sm_count} SMs",
        RuntimeWarning,
        stacklevel=4,
    )


_UNDESCRIBED_SEEN: set = set()


# ---- prepared launches --------------------------------------------------------------------------
def _prepare(key, q, k, v, causal, softmax_scale):
    empty = check_inputs(q, k, v, causal)  # (attention() has checked requires_grad already)
    check_scale(softmax_scale)
    check_device(q, k, v, aligned=not empty)  # nothing is read from empty inputs
    target, family = device_target(q.device)  # empty inputs too: refusal does not depend on sizes
    if empty:
        launch = _Empty()
        with _PREPARE_LOCK:
            _remember(key, launch)
        return launch
    problem = make_problem(q, k, v, causal)
    _say_undescribed(target)
    config = lookup(problem, target, kernel=family.name).config
    with _PREPARE_LOCK:
        launch = _LAUNCHES.get(key) if key is not None else None
        if launch is None:
            launch = family.prepare_launch(problem, config, target, q, k, v, softmax_scale)
            _remember(key, launch)
    return launch


def _prepare_varlen(key, q, k, v, ragged: Ragged, causal, softmax_scale):
    empty = check_varlen_inputs(q, k, v, ragged, causal)
    check_scale(softmax_scale)
    check_varlen_device(q, k, v, ragged, aligned=not empty)
    target, family = device_target(q.device)
    if empty:
        launch = _EmptyVarlen(ragged.varlen_q)
        with _PREPARE_LOCK:
            _remember(key, launch)
        return launch
    problem = make_varlen_problem(q, k, v, ragged, causal)
    _say_undescribed(target)
    config = lookup(problem, target, kernel=family.name).config
    with _PREPARE_LOCK:
        launch = _LAUNCHES.get(key) if key is not None else None
        if launch is None:
            launch = family.prepare_launch(
                problem, config, target, q, k, v, softmax_scale, ragged=ragged
            )
            _remember(key, launch)
    return launch


def _remember(key, launch) -> None:
    """Keep a prepared launch for its key (the caller holds _PREPARE_LOCK)."""
    if key is not None:
        _LAUNCHES.put(key, launch)


class _EmptyVarlen:
    """A ragged call with nothing to compute: O zero and LSE -inf in flash-attn-4's varlen shapes
    (those of each call: the calls of one signature may differ in their packed rows), without a
    kernel."""

    def __init__(self, varlen_q: bool) -> None:
        self.varlen_q = varlen_q

    def __call__(self, q, k, v, *index):
        import torch

        shapes = None
        if self.varlen_q:
            shapes = packed_output_shapes(q.shape[0], q.shape[1], v.shape[-1])
        with torch.cuda.device(q.device):
            return empty_outputs(q, v, shapes=shapes)


class _Empty:
    """Inputs with nothing to compute (no batch, query rows or keys): O zero and LSE -inf on the
    tensors' device and its current stream, without a kernel."""

    def __call__(self, q, k, v):
        import torch

        with torch.cuda.device(q.device):
            return empty_outputs(q, v)
