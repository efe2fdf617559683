"""Host-side cost of one forward call: fa4tune's entry points against calling the compiled kernel
with prepared arguments (and flash-attn-4 when installed). Prints microseconds per call.

Measured on a tiny problem so the GPU never holds the host back: each entry point is called in
bursts of 100 with the host clock read around each call, and the queue is drained between bursts
(untimed). The entry points take turns, a burst each per round, so that a slow spell of the host
falls on all of them alike; the last column is each row's median minus the compiled kernel's.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def interleaved_us(rows: dict, rounds: int = 40, burst: int = 100) -> dict:
    """{name: sorted host microseconds per call} of each callable, measured in turns."""
    import torch

    for fn in rows.values():  # warm-up: caches, allocator pools, lazy loading
        for _ in range(50):
            fn()
    torch.cuda.synchronize()
    samples = {name: [] for name in rows}
    clock = time.perf_counter
    for _ in range(rounds):
        for name, fn in rows.items():
            got = samples[name]
            for _ in range(burst):
                start = clock()
                fn()
                got.append((clock() - start) * 1e6)
            torch.cuda.synchronize()
    return {name: sorted(values) for name, values in samples.items()}


def main() -> int:
    import math

    import torch
    from cuda.bindings import driver as cuda
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import from_dlpack

    from fa4tune.kernels.common.streams import current_tile_counter, tile_counter
    from fa4tune.kernels.fa4_fwd_sm90.compile import compile_forward
    from fa4tune.kernels.fa4_fwd_sm90.config import FwdConfig
    from fa4tune.kernels.fa4_fwd_sm90.launch import PreparedLaunch, attention_forward

    if not torch.cuda.is_available():
        print("benchmarks/dispatch.py needs an NVIDIA GPU", file=sys.stderr)
        return 2
    q, k, v = (torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = torch.empty_like(q)
    lse = torch.empty(1, 1, 128, device="cuda", dtype=torch.float32)
    cfg = FwdConfig()
    compiled = compile_forward(cfg, "bf16", 128, 128, False)
    args = [
        from_dlpack(t, assumed_align=16).mark_layout_dynamic(leading_dim=3) for t in (q, k, v, out)
    ]
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")
    args += [
        from_dlpack(lse, assumed_align=4).mark_layout_dynamic(leading_dim=2),
        from_dlpack(counter, assumed_align=4),
        Float32(1 / math.sqrt(128) * math.log2(math.e)),
        Int32(1),
        cuda.CUstream(torch.cuda.current_stream().cuda_stream),
    ]
    import fa4tune
    from fa4tune.runtime import dispatch

    fa4tune.attention(q, k, v)  # prepares the launch
    launch = next(iter(dispatch._LAUNCHES.values()))
    # The floor rows get a launch of their own (fa4tune.attention rewrites its launch's pointers),
    # pointed once at tensors that stay alive.
    floor = PreparedLaunch(
        launch.problem, launch.config, dispatch.device_target(q.device)[0], q, k, v, None
    )
    floor.bind(
        compile_forward(launch.config, "bf16", 128, 128, False).function.to(launch.device_index)
    )
    for pointer, t in zip(floor.pointers, (q, k, v, out, lse, counter)):
        pointer.value = t.data_ptr()
    handle = torch.cuda.current_stream().cuda_stream
    floor.stream.value = handle
    # A decode call (one query, 32 query heads over 8 K/V heads, 8k keys): its config packs GQA and
    # splits K/V (16 ways by the default rule), so a call allocates the partials and launches the
    # kernel and the combine.
    qd = torch.randn(1, 1, 32, 128, device="cuda", dtype=torch.bfloat16)
    kd, vd = (torch.randn(1, 8192, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    decode_config = dispatch.explain(qd, kd, vd).config
    # The decode call's prepared launch (what fa4tune.attention calls after its lookup) with the
    # splits merged by the combine kernel (two launches) and by the tiles' last CTAs (one), the
    # same config otherwise: the host cost of the second launch.
    from dataclasses import replace

    from fa4tune.kernels.common.inputs import make_problem
    from fa4tune.kernels.fa4_fwd_sm90.launch import prepare_launch

    decode_problem = make_problem(qd, kd, vd, False)
    decode_target = dispatch.device_target(qd.device)[0]
    merges = {}
    for in_kernel in (False, True) if decode_config.split else ():
        merge_config = replace(decode_config, combine_in_kernel=in_kernel)
        merges[in_kernel] = prepare_launch(
            decode_problem, merge_config, decode_target, qd, kd, vd, None
        )
    op = torch.ops.fa4tune.attention.default
    traced = torch.compile(fa4tune.attention, fullgraph=True)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    direct = "yes" if launch.result is not None else "no: the DSL's run_compiled_program (fallback)"
    rows = {
        "compiled kernel, prepared DSL arguments (the reference)": lambda: compiled.function(*args),
        "fa4tune.attention (lookup, allocates out and lse, launch)": lambda: fa4tune.attention(
            q, k, v
        ),
        "fa4tune.attention, causal (also fetches the stream's tile counter)": lambda: (
            fa4tune.attention(q, k, v, causal=True)
        ),
        f"fa4tune.attention, decode ({decode_config.short()})": lambda: fa4tune.attention(
            qd, kd, vd
        ),
        "the torch op torch.ops.fa4tune.attention, called eagerly": lambda: op(
            q, k, v, False, None
        ),
        "fa4tune.attention inside torch.compile(fullgraph=True)": lambda: traced(q, k, v),
        "torch SDPA (F.scaled_dot_product_attention, same shape)": lambda: sdpa(qt, kt, vt),
        "its floor: the host function called with the packed pointer array": floor._run,
        "the DSL's run_compiled_program with the same packed arguments": lambda: (
            floor.executor.run_compiled_program(floor.arguments)
        ),
        "attention_forward (converts tensors every call)": lambda: attention_forward(
            q, k, v, cfg, out=out, lse=lse
        ),
        "the causal call's counter lookup alone (torch's stream id)": lambda: current_tile_counter(
            q.device
        ),
        "the same through the two driver queries (tile_counter)": lambda: tile_counter(
            q.device, handle
        ),
    }
    if merges:
        rows["the decode call's prepared launch, splits merged by the combine kernel"] = partial(
            merges[False], qd, kd, vd
        )
        rows["the same, splits merged by the tiles' last CTAs (combine_in_kernel)"] = partial(
            merges[True], qd, kd, vd
        )
    else:
        print(f"# {decode_config.short()} does not split: no merge rows", file=sys.stderr)
    try:
        from flash_attn.cute import flash_attn_func

        rows["flash-attn-4 flash_attn_func"] = lambda: flash_attn_func(q, k, v)
    except Exception as exc:
        print(f"# flash-attn-4 not measured: {type(exc).__name__}", file=sys.stderr)
    print(
        f"# fa4tune.attention used config {launch.config.short()} "
        f"({dispatch.explain(q, k, v).source} in the "
        f"lookup); direct host call: {direct}; {torch.cuda.get_device_name()}",
        file=sys.stderr,
    )
    results = interleaved_us(rows)
    reference = results[next(iter(rows))]
    base = reference[len(reference) // 2]
    print(
        "| entry point | host µs per call: median | p99 | median minus the reference |\n"
        "|---|---|---|---|"
    )
    for name, values in results.items():
        median, p99 = values[len(values) // 2], values[int(len(values) * 0.99)]
        print(f"| {name} | {median:.1f} | {p99:.1f} | {median - base:+.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
