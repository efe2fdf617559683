"""Launch fa4tune and flash-attn-4 once each per shape, for a profiler to capture side by side:

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \
        -k regex:'kernel_cutlass' python3 benchmarks/profile_pair.py 128:1024 128:1024:causal

Shapes are head_dim:seqlen[:causal][:gN] with 16k tokens and hidden 2048.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str]) -> int:
    import torch

    from benchmarks.attention import parse_shape
    from fa4tune.kernels.fa4_fwd_sm90 import FAMILY
    from fa4tune.kernels.fa4_fwd_sm90.launch import attention_forward

    try:
        from flash_attn.cute import flash_attn_func
    except Exception:
        flash_attn_func = None
    for spec in argv or ["128:1024"]:
        p = parse_shape(spec)
        d, s, causal = p.head_dim, p.seqlen_q, p.causal
        q, k, v = (
            torch.randn(p.batch, s, p.nheads_q, d, device="cuda", dtype=torch.bfloat16)
            for _ in range(3)
        )
        attention_forward(q, k, v, FAMILY.default_config(p), causal=causal)
        if flash_attn_func is not None:
            flash_attn_func(q, k, v, causal=causal)
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
