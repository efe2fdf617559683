"""fa4tune as a transformers attention implementation on the GPU: a small, randomly initialised
Llama with GQA gives sdpa's logits within bf16 tolerance and the same greedy tokens, with every
attention call on fa4tune's kernel; a padded batch falls back to sdpa and still matches."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from fa4tune.integrations import transformers as ft  # noqa: E402
from fa4tune.runtime import ops  # noqa: E402


def twin_models(with_fp32=False):
    """(sdpa model, fa4tune model), one Llama architecture and weights: 4 layers, 16 query heads
    over 4 KV heads of head_dim 128, bf16 on the GPU; with_fp32 adds the same model in float32
    with eager attention (the reference the two bf16 models are measured against)."""
    torch.manual_seed(0)

    def config():
        return LlamaConfig(
            vocab_size=1024,
            hidden_size=2048,
            intermediate_size=4096,
            num_hidden_layers=4,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            max_position_embeddings=4096,
            initializer_range=0.05,  # peaked logits: greedy tokens far from ties
        )

    sdpa, mine = (
        AutoModelForCausalLM.from_config(config(), attn_implementation=name, dtype=torch.bfloat16)
        for name in ("sdpa", "fa4tune")
    )
    mine.load_state_dict(sdpa.state_dict())
    models = [sdpa.cuda().eval(), mine.cuda().eval()]
    if with_fp32:
        exact = AutoModelForCausalLM.from_config(
            config(), attn_implementation="eager", dtype=torch.float32
        )
        exact.load_state_dict(sdpa.state_dict())
        models.append(exact.cuda().eval())
    return models


@pytest.fixture
def counted(monkeypatch):
    """fa4tune.attention as the integration calls it, counting its calls; FallbackWarning raises."""
    calls = []
    real = ops.attention

    def counting(q, k, v, causal=False, softmax_scale=None):
        calls.append((tuple(q.shape), tuple(k.shape), causal))
        return real(q, k, v, causal=causal, softmax_scale=softmax_scale)

    monkeypatch.setattr(ops, "attention", counting)
    monkeypatch.setattr(ft, "_WARNED", set())
    return calls


def relative_error(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_logits_and_greedy_tokens_match_sdpa_on_the_kernel(counted):
    sdpa, mine, exact = twin_models(with_fp32=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, 1024, (2, 700), device="cuda", generator=gen)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", ft.FallbackWarning)
        want, got = sdpa(ids).logits, mine(ids).logits
        assert len(counted) == 4 and all(c[2] for c in counted)  # one causal call per layer
        # bf16 tolerance: fa4tune's logits as close to the float32 model's as sdpa's are.
        truth = exact(ids).logits
        err, err_sdpa = relative_error(got, truth), relative_error(want, truth)
        assert err < 1.25 * err_sdpa + 1e-3, (err, err_sdpa)
        assert relative_error(got, want) < 4e-2
        # How far the two disagree on a next-token decision: the prompt's last logits.
        noise = (got[:, -1].float() - want[:, -1].float()).abs().max().item()
        # Greedy generation on the kernel: prefill, then decode steps of one query row over the
        # cache; and sdpa's logits on the same tokens, teacher-forced in one pass.
        ones = torch.ones_like(ids)
        prompt = dict(input_ids=ids, attention_mask=ones, max_new_tokens=24, do_sample=False)
        counted.clear()
        result = mine.generate(**prompt, output_scores=True, return_dict_in_generate=True)
        decode = [c for c in counted if c[0][1] == 1]
        assert len(decode) == 4 * 23 and len(counted) == 4 * 24
        tokens = result.sequences
        forced = sdpa(tokens).logits[:, ids.shape[1] - 1 : -1].float()
        tokens_sdpa = sdpa.generate(**prompt)
    steps = torch.stack(result.scores, dim=1).float()  # the kernel's logits at each step
    new = tokens[:, ids.shape[1] :]
    for t in range(new.shape[1]):
        err = relative_error(steps[:, t], forced[:, t])
        assert err < 4e-2, f"step {t}: the decode logits are {err:.3g} off sdpa's"
    # Every greedy choice is sdpa's best token, or within the two models' disagreement of it
    # (a tie in bf16, which either may break; a random model's logits are nearly flat).
    best = forced.max(dim=-1).values
    chosen = forced.gather(-1, new[..., None])[..., 0]
    assert ((best - chosen) <= 1.5 * noise).all(), ((best - chosen).max().item(), noise)
    same = (tokens_sdpa == tokens).all(dim=0)[ids.shape[1] :]
    first = int(same.logical_not().nonzero()[0]) if not same.all() else len(same)
    print(f"greedy tokens identical to sdpa's for the first {first} of {len(same)} steps")


def test_a_padded_batch_falls_back_to_sdpa_and_matches(counted):
    sdpa, mine = twin_models()
    ids = torch.randint(0, 1024, (2, 300), device="cuda")
    padding = torch.ones_like(ids)
    padding[1, :40] = 0
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = sdpa(ids, attention_mask=padding).logits
        got = mine(ids, attention_mask=padding).logits
    assert torch.equal(got, want) and counted == []
    assert [w for w in caught if issubclass(w.category, ft.FallbackWarning)]
