"""fa4tune.integrations.transformers on the CPU: registration, the mask function's decisions, the
fallbacks to sdpa (each with one warning), and the glue between transformers' layout and
fa4tune.attention, checked with the fp32 reference standing in for the kernel. The real kernel
runs in test_transformers_gpu.py."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402
from transformers.masking_utils import (  # noqa: E402
    ALL_MASK_ATTENTION_FUNCTIONS,
    bidirectional_mask_function,
    sdpa_mask,
    sliding_window_causal_mask_function,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from fa4tune.integrations import transformers as ft  # noqa: E402
from fa4tune.kernels.common.reference import attention_reference  # noqa: E402
from fa4tune.runtime import ops  # noqa: E402


def tiny_llama_config(**changes) -> LlamaConfig:
    """A small Llama with GQA (4 query heads per KV head pair), head_dim 64."""
    fields = dict(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
        initializer_range=0.1,  # peaked logits: greedy tokens far from ties
    )
    fields.update(changes)
    return LlamaConfig(**fields)


def twin_models(dtype=torch.bfloat16, **changes):
    """(sdpa model, fa4tune model) with the same random weights, in eval mode."""
    torch.manual_seed(0)
    # A config each: a model reads its config's attention implementation at every call.
    sdpa, mine = (
        AutoModelForCausalLM.from_config(
            tiny_llama_config(**changes), attn_implementation=name, dtype=dtype
        )
        for name in ("sdpa", "fa4tune")
    )
    mine.load_state_dict(sdpa.state_dict())
    assert sdpa.config._attn_implementation == "sdpa"
    return sdpa.eval(), mine.eval()


@pytest.fixture
def warned(monkeypatch):
    """A fresh record of the causes warned about."""
    monkeypatch.setattr(ft, "_WARNED", set())


@pytest.fixture
def stand_in(monkeypatch, warned):
    """fa4tune.attention replaced by the fp32 reference (cast to the inputs' dtype), with the CPU
    taken as a device the kernel serves; yields the calls' (q shape, k shape, causal, scale)."""
    calls = []

    def reference(q, k, v, causal=False, softmax_scale=None):
        assert q.stride(-1) == 1 and q.shape[1] <= k.shape[1]
        calls.append((tuple(q.shape), tuple(k.shape), causal, softmax_scale))
        out, lse = attention_reference(q, k, v, causal, softmax_scale)
        return out.to(q.dtype), lse

    monkeypatch.setattr(ops, "attention", reference)
    monkeypatch.setitem(ft._DEVICES, torch.device("cpu"), None)
    yield calls


def relative_error(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fa4tune_is_registered_for_attention_and_masks():
    assert ALL_ATTENTION_FUNCTIONS["fa4tune"] is ft.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["fa4tune"] is ft.attention_mask
    sdpa, mine = twin_models()
    assert mine.config._attn_implementation == "fa4tune"


def mask(**kwargs):
    fields = dict(batch_size=2, q_length=5, kv_length=5, device="cpu", dtype=torch.bfloat16)
    fields.update(kwargs)
    return ft.attention_mask(**fields)


def test_the_mask_is_none_exactly_where_the_kernel_makes_it_itself():
    ones = torch.ones(2, 12, dtype=torch.bool)
    # The kernel's own masks: causal, bottom-right aligned (prefill, decode, a chunk after a
    # dynamic cache), and none (bidirectional), without padding.
    assert mask() is None
    assert mask(q_length=1, kv_length=12, q_offset=11, attention_mask=ones) is None
    assert mask(q_length=4, kv_length=12, q_offset=8, attention_mask=ones) is None
    assert mask(mask_function=bidirectional_mask_function, q_length=3, kv_length=9) is None
    # Everything else is sdpa's boolean mask, never skipped.
    padded = ones.clone()
    padded[0, :3] = False
    cases = [
        dict(q_length=4, kv_length=12, q_offset=8, attention_mask=padded),
        dict(q_length=4, kv_length=12, q_offset=0),  # a static cache: keys past the queries
        dict(q_length=1, kv_length=12, q_offset=torch.tensor(5)),  # a static cache's offset
        dict(mask_function=sliding_window_causal_mask_function(4), local_size=4),
        dict(mask_function=bidirectional_mask_function, kv_length=12, attention_mask=padded),
    ]
    for case in cases:
        got = mask(**case)
        fields = dict(batch_size=2, q_length=5, kv_length=5, device="cpu")
        fields.update(case)
        want = sdpa_mask(**fields, allow_is_causal_skip=False)
        assert got is not None and got.dtype == torch.bool and torch.equal(got, want), case


def test_on_the_cpu_every_call_falls_back_to_sdpa_with_one_warning(warned):
    sdpa, mine = twin_models()
    ids = torch.randint(0, 256, (2, 20))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want, got = sdpa(ids).logits, mine(ids).logits
        mine(ids)
    assert torch.equal(want, got)
    [warning] = [w for w in caught if issubclass(w.category, ft.FallbackWarning)]
    assert "not on a Hopper GPU" in str(warning.message) and "sdpa" in str(warning.message)


def test_the_kernel_gets_transformers_calls_in_its_own_layout(stand_in):
    sdpa, mine = twin_models()
    ids = torch.randint(0, 256, (2, 20))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", ft.FallbackWarning)  # no call may fall back
        want, got = sdpa(ids).logits, mine(ids).logits
    assert relative_error(got, want) < 1e-2
    scale = 64**-0.5
    assert stand_in == [((2, 20, 4, 64), (2, 20, 2, 64), True, scale)] * 2  # one per layer


def test_greedy_generation_matches_sdpa_with_prefill_and_decode_on_the_kernel(stand_in):
    sdpa, mine = twin_models()
    ids = torch.randint(0, 256, (2, 12))
    ones = torch.ones_like(ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ft.FallbackWarning)
        want = sdpa.generate(ids, attention_mask=ones, max_new_tokens=10, do_sample=False)
        got = mine.generate(ids, attention_mask=ones, max_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    prefill = [c for c in stand_in if c[0][1] == 12]
    decode = [c for c in stand_in if c[0][1] == 1]
    assert prefill and all(c[2] for c in prefill)  # causal over the prompt
    # one query row sees every key: the non-causal kernel, over the cache as it grows
    assert decode and not any(c[2] for c in decode)
    assert {c[1][1] for c in decode} == set(range(13, 22))


def test_padding_falls_back_to_sdpa_with_one_warning_and_no_kernel_call(stand_in):
    sdpa, mine = twin_models()
    ids = torch.randint(0, 256, (2, 16))
    padding = torch.ones_like(ids)
    padding[0, :5] = 0
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want, got = (
            sdpa(ids, attention_mask=padding).logits,
            mine(ids, attention_mask=padding).logits,
        )
    assert torch.equal(want, got) and stand_in == []
    [warning] = [w for w in caught if issubclass(w.category, ft.FallbackWarning)]
    assert "mask" in str(warning.message)


def test_a_static_cache_falls_back_rather_than_attend_to_its_empty_slots(stand_in):
    sdpa, mine = twin_models()
    ids = torch.randint(0, 256, (1, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kwargs = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
        want, got = sdpa.generate(ids, **kwargs), mine.generate(ids, **kwargs)
    assert torch.equal(want, got) and stand_in == []
    assert any(issubclass(w.category, ft.FallbackWarning) for w in caught)


@pytest.mark.parametrize(
    "case, cause",
    [
        ("train", "backward"),
        ("float32", "bfloat16 or float16"),
        ("head_dim_80", "head dims"),
        ("dropout", "dropout"),
    ],
)
def test_calls_the_kernel_cannot_serve_fall_back_with_the_cause_named(stand_in, case, cause):
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    changes = dict(head_dim=80) if case == "head_dim_80" else {}
    sdpa, mine = twin_models(dtype=dtype, **changes)
    layer = mine.model.layers[0].self_attn
    batch, seqlen = 2, 10
    heads, kv_heads, dim = 4, 2, layer.head_dim
    query = torch.randn(batch, heads, seqlen, dim, dtype=dtype)
    key, value = (torch.randn(batch, kv_heads, seqlen, dim, dtype=dtype) for _ in "kv")
    if case == "train":
        query.requires_grad_()
    dropout = 0.1 if case == "dropout" else 0.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, weights = ft.attention_forward(
            layer, query, key, value, None, dropout=dropout, scaling=0.1
        )
        assert out.shape == (batch, seqlen, heads, dim) and weights is None
    assert stand_in == []
    [warning] = [w for w in caught if issubclass(w.category, ft.FallbackWarning)]
    assert cause in str(warning.message)
    if case == "train":
        out.float().sum().backward()  # sdpa trains
        assert query.grad is not None


@pytest.mark.parametrize("feature", ["softcap", "s_aux"])
def test_calls_sdpa_cannot_serve_either_are_refused_by_name(stand_in, feature):
    """A soft cap or attention sinks: sdpa would not apply them (transformers 5.17's sdpa ignores a
    soft cap), so the call raises, naming the eager implementation."""
    from fa4tune.errors import UnsupportedInput

    sdpa, mine = twin_models()
    layer = mine.model.layers[0].self_attn
    query = torch.randn(1, 4, 6, 64, dtype=torch.bfloat16)
    key = value = torch.randn(1, 2, 6, 64, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedInput, match=f"{feature}.*attn_implementation='eager'"):
        ft.attention_forward(layer, query, key, value, None, **{feature: 30.0})
    assert stand_in == []


def test_inputs_the_kernel_refuses_after_the_checks_fall_back_too(monkeypatch, warned):
    """An UnsupportedInput from fa4tune.attention itself (raised before anything runs) sends the
    call to sdpa, with the kernel's words."""
    from fa4tune.errors import UnsupportedInput

    def refuse(*args, **kwargs):
        raise UnsupportedInput("q must start at a 16-byte aligned address")

    monkeypatch.setattr(ops, "attention", refuse)
    monkeypatch.setitem(ft._DEVICES, torch.device("cpu"), None)
    sdpa, mine = twin_models()
    ids = torch.randint(0, 256, (1, 9))
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(sdpa(ids).logits, mine(ids).logits)
    [warning] = [w for w in caught if issubclass(w.category, ft.FallbackWarning)]
    assert "16-byte aligned" in str(warning.message)
