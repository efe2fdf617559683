"""Greedy generation with a Hugging Face transformers model on fa4tune's tuned kernels, next to the
same model on sdpa.

    python examples/hf_generate.py                      # a small random Llama (no download)
    python examples/hf_generate.py --model NAME_OR_PATH --prompt "The capital of France is"

Needs an H100 or H200 and `pip install 'fa4tune[transformers]'`. Importing
fa4tune.integrations.transformers registers the "fa4tune" attention implementation; calls the
kernel cannot serve (a padded batch, say) run on sdpa, with a warning once per cause. With a
random model the two part at the first near-tie of its nearly flat logits (a few tokens in, at
8 layers); a trained model's greedy tokens are a meaningful comparison."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a model name or path (default: a small random Llama)")
    parser.add_argument("--prompt", default="The capital of France is")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    import fa4tune.integrations.transformers  # noqa: F401  (registers "fa4tune")

    if not torch.cuda.is_available():
        print("examples/hf_generate.py needs an NVIDIA Hopper GPU", file=sys.stderr)
        return 2
    tokenizer = None
    if args.model:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids.cuda()

        def load(name):
            return AutoModelForCausalLM.from_pretrained(
                args.model, attn_implementation=name, dtype=torch.bfloat16, device_map="cuda"
            )
    else:
        ids = torch.randint(0, 32000, (1, 64), device="cuda", generator=torch.Generator("cuda"))

        def load(name):
            torch.manual_seed(0)  # the same random weights for both
            config = LlamaConfig(
                hidden_size=2048,
                intermediate_size=5632,
                num_hidden_layers=8,
                num_attention_heads=16,
                num_key_value_heads=4,
                head_dim=128,
                initializer_range=0.05,
            )
            return AutoModelForCausalLM.from_config(
                config, attn_implementation=name, dtype=torch.bfloat16
            ).cuda()

    results = {}
    for name in ("sdpa", "fa4tune"):
        model = load(name).eval()
        kwargs = dict(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=args.new_tokens,
            do_sample=False,
        )
        model.generate(**kwargs)  # warm-up: compiles the kernels a first call needs
        torch.cuda.synchronize()
        start = time.perf_counter()
        tokens = model.generate(**kwargs)
        torch.cuda.synchronize()
        results[name] = (tokens, time.perf_counter() - start)
        del model
    a, b = (results[name][0][0, ids.shape[1] :] for name in ("sdpa", "fa4tune"))
    for name, (tokens, seconds) in results.items():
        new = tokens[0, ids.shape[1] :]
        text = tokenizer.decode(new) if tokenizer else new.tolist()
        print(f"{name:8} {seconds * 1e3:7.1f} ms  {text}")
    differ = (a != b).nonzero().flatten().tolist()
    if not differ:
        print(f"the same {len(a)} tokens")
        return 0
    print(f"the tokens agree for the first {differ[0]} of {len(a)} steps")
    if not args.model:
        print("(a random model's logits are nearly flat: greedy tokens part at its first bf16 tie)")
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
