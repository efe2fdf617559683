"""fa4tune as a Hugging Face transformers attention implementation, named "fa4tune".

    import fa4tune.integrations.transformers  # registers "fa4tune"
    model = AutoModelForCausalLM.from_pretrained(
        name, attn_implementation="fa4tune", dtype=torch.bfloat16, device_map="cuda"
    )

Importing this module registers two functions under the name: the attention function in
transformers' AttentionInterface, and a mask function in its AttentionMaskInterface. (Without a
mask function of its own, transformers would hand a custom implementation no mask at all, padding
included.) The mask function returns None exactly when the call's mask is what the kernel computes
by itself: no mask (bidirectional attention without padding), or the causal mask aligned to the
bottom right (no padding, no window, the last query at the last key: a dynamic cache, or none). For
anything else it returns sdpa's boolean mask, and the attention function gives that call to sdpa.

The attention function runs `fa4tune.attention` with the tuned config for the call's shapes. Where
the kernel cannot serve a call it runs transformers' sdpa instead, and says why with one
`FallbackWarning` per cause: a mask (padding, a static cache, a sliding window, packed sequences or
a custom mask), dropout, gradients (until the backward kernel has run on a GPU), a dtype or head
dim the kernel lacks, a device that is not a Hopper GPU. It never runs the kernel on a call whose
result would differ. A call that sdpa cannot serve either (a soft cap, attention sinks) raises
UnsupportedInput, which names attn_implementation="eager"."""

from __future__ import annotations

import warnings

import torch

from ..errors import UnsupportedInput
from ..kernels.common.inputs import check_inputs
from ..runtime import dispatch, ops

try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import (
        AttentionMaskInterface,
        bidirectional_mask_function,
        causal_mask_function,
        prepare_padding_mask,
        sdpa_mask,
    )
except ImportError as exc:  # not installed, or a transformers without these interfaces
    raise ImportError(
        "fa4tune.integrations.transformers needs transformers 5 or later with AttentionInterface "
        f"and AttentionMaskInterface (pip install 'fa4tune[transformers]'): {exc}"
    ) from exc

NAME = "fa4tune"

__all__ = ["NAME", "FallbackWarning", "attention_forward", "attention_mask", "register"]


class FallbackWarning(UserWarning):
    """A call that fa4tune's kernel cannot serve ran on sdpa; shown once per cause."""


def register(name: str = NAME) -> None:
    """Register the attention and mask functions under `name` (done for "fa4tune" on import)."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention call: query (batch, heads, seqlen_q, head_dim), key and value
    (batch, kv heads, seqlen_k, head_dim); returns the output as (batch, seqlen_q, heads,
    head_dim_v) and no attention weights, as sdpa's function does."""
    for name in _NEITHER:  # sdpa would be wrong too (some transformers releases ignore a soft cap)
        if kwargs.get(name) is not None:
            raise UnsupportedInput(
                f"fa4tune attention: the call asks for {name}, which neither fa4tune's kernel nor "
                "sdpa does; load the model with attn_implementation='eager'"
            )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    cause = _cause_to_fall_back(query, key, value, attention_mask, dropout, causal, kwargs)
    if cause is None:
        # A single query row sees every key under the bottom-right causal mask.
        causal = bool(causal) and query.shape[2] > 1
        q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        try:
            out, _ = ops.attention(q, k, v, causal=causal, softmax_scale=scaling)
            return out, None
        except UnsupportedInput as exc:  # raised before anything runs (strides, alignment, ...)
            cause = ("input", f"fa4tune.attention refused the inputs: {exc}")
    _warn_once(*cause)
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


def attention_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' mask call: None where the kernel computes the mask itself (see the module),
    else sdpa's 4-D boolean mask, never skipped."""
    if local_size is None and not isinstance(q_offset, torch.Tensor):
        aligned = mask_function is bidirectional_mask_function or (
            mask_function is causal_mask_function and q_offset - kv_offset == kv_length - q_length
        )
        if aligned:
            padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
            if padding is None or bool(padding.all()):
                return None
    for skip in ("allow_is_causal_skip", "allow_is_bidirectional_skip"):
        kwargs.pop(skip, None)
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,
        allow_is_bidirectional_skip=False,
        **kwargs,
    )


# ---- when the kernel cannot serve a call ---------------------------------------------------------
def _cause_to_fall_back(query, key, value, mask, dropout, causal, kwargs):
    """(cause, explanation) of why the kernel cannot serve this call, or None when it can."""
    if mask is not None:
        return "mask", (
            "the call has an attention mask (padding, a static cache, a sliding window, packed "
            "sequences or a custom mask), which the kernel does not apply"
        )
    if dropout:
        return "dropout", f"the call asks for dropout ({dropout}), which the kernel does not do"
    for name in ("sliding_window", "position_bias"):
        if kwargs.get(name) is not None:
            return name, f"the call asks for {name}, which the kernel does not do"
    if torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    ):
        return "grad", (
            "the call records gradients (training), and fa4tune's backward kernel has not yet "
            "been verified on a GPU (docs/backward.md); run inference under torch.no_grad() or "
            "torch.inference_mode()"
        )
    if not isinstance(causal, bool):
        return "causal", f"is_causal is {causal!r}, not a bool"
    device = _device_refusal(query.device)
    if device is not None:
        return "device", device
    try:
        check_inputs(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), False)
    except UnsupportedInput as exc:  # dtype, head dims, GQA ratio
        return "input", f"fa4tune.attention does not take these inputs: {exc}"
    return None


def _device_refusal(device) -> str | None:
    """Why the kernel cannot run on `device` (a CPU, a GPU it does not serve), or None; asked once
    per device."""
    if device not in _DEVICES:
        if device.type != "cuda":
            _DEVICES[device] = f"the tensors are on {device}, not on a Hopper GPU"
        else:
            try:
                dispatch.device_target(device)
                _DEVICES[device] = None
            except UnsupportedInput as exc:
                _DEVICES[device] = str(exc)
    return _DEVICES[device]


_NEITHER = ("softcap", "s_aux", "sinks")  # features of the call that sdpa lacks too
_DEVICES: dict = {}
_WARNED: set = set()


def _warn_once(cause: str, explanation: str) -> None:
    if cause in _WARNED:
        return
    _WARNED.add(cause)
    warnings.warn(
        f"fa4tune attention: {explanation}; running transformers' sdpa for such calls "
        "(this warning is shown once per cause)",
        FallbackWarning,
        stacklevel=3,
    )


register()
