"""fa4tune: measure-driven autotuning of FlashAttention-4-style attention kernels."""

__version__ = "0.1.0"
