"""Host-side cost of one forward call: fa4tune's entry points against calling the compiled kernel with
prepared arguments (and flash-attn-4 when installed). Prints microseconds per call.

Measured on a tiny problem so the GPU never holds the host back: calls are issued in bursts of 100 and
the host clock is read around each call (the queue is drained between bursts, outside the timed region).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_call_us(fn, calls: int = 2000, burst: int = 100) -> tuple[float, float, float]:
    """(median, p99, max) host microseconds of one call. Calls go in bursts with the queue drained
    between them (untimed), so that the launch queue never fills and blocks the host on the GPU."""
    import torch

    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    samples = []
    while len(samples) < calls:
        for _ in range(burst):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    samples.sort()
    return samples[len(samples) // 2], samples[int(len(samples) * 0.99)], samples[-1]


def main() -> int:
    import math

    import torch
    from cuda.bindings import driver as cuda
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import from_dlpack

    from fa4tune.kernels.config import FwdConfig
    from fa4tune.kernels.interface import attention_forward, compile_forward

    if not torch.cuda.is_available():
        print("benchmarks/dispatch.py needs an NVIDIA GPU", file=sys.stderr)
        return 2
    q, k, v = (torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(1, 1, 128, device="cuda", dtype=torch.float32)
    cfg = FwdConfig()
    compiled = compile_forward(cfg, "bf16", 128, 128, False)
    args = [from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=3) for t in (q, k, v, out)]
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    args += [from_dlpack(lse, assumed_align=4).mark_layout_dynamic(leading_dim=2),
             from_dlpack(counter, assumed_align=4), Float32(1 / math.sqrt(128) * math.log2(math.e)), Int32(1),
             cuda.CUstream(torch.cuda.current_stream().cuda_stream)]
    rows = [
        ("compiled kernel, prepared arguments", per_call_us(lambda: compiled.function(*args))),
        ("fa4tune.kernels.interface.attention_forward", per_call_us(
            lambda: attention_forward(q, k, v, cfg, out=out, lse=lse))),
    ]
    import fa4tune
    from fa4tune import dispatch

    rows.append(("fa4tune.attention (lookup + dispatch, allocates out and lse)",
                 per_call_us(lambda: fa4tune.attention(q, k, v))))
    # The floor under fa4tune.attention: its prepared launch without the allocation and the key lookup.
    launch = next(iter(dispatch._LAUNCHES.values()))
    stream = torch.cuda.current_stream().cuda_stream
    for pointer, t in zip(launch.pointers, (q, k, v, out, lse, counter)):  # tensors that stay alive
        pointer.value = t.data_ptr()

    def packed_launch():
        launch.stream.value = stream
        launch.executor.run_compiled_program(launch.arguments)

    rows.append(("compiled host function, packed arguments (fa4tune.attention's floor)", per_call_us(packed_launch)))
    # Causal: the table's kernel is persistent, so each call also fetches the stream's tile counter.
    rows.append(("fa4tune.attention, causal (also fetches the stream's tile counter)",
                 per_call_us(lambda: fa4tune.attention(q, k, v, causal=True))))
    print(f"# fa4tune.attention used config {launch.config.short()} "
          f"({dispatch.explain(q, k, v).source} in the lookup)", file=sys.stderr)
    try:
        from flash_attn.cute import flash_attn_func

        rows.append(("flash-attn-4 flash_attn_func", per_call_us(lambda: flash_attn_func(q, k, v))))
    except Exception as exc:
        print(f"# flash-attn-4 not measured: {type(exc).__name__}", file=sys.stderr)
    print("| entry point | host µs per call: median | p99 | max |\n|---|---|---|---|")
    for name, (med, p99, worst) in rows:
        print(f"| {name} | {med:.1f} | {p99:.1f} | {worst:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
