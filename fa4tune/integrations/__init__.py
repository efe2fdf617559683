"""fa4tune where users already call attention: `fa4tune.integrations.transformers` registers the
tuned kernels as a Hugging Face transformers attention implementation (the `[transformers]` extra).
torch.compile and torch.export need nothing from here: `fa4tune.attention` is a torch.library op
(fa4tune.runtime.ops)."""
