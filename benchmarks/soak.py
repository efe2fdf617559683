"""A serving-style soak of fa4tune.attention_varlen: many calls with shapes drawn from a serving
trace, with host and GPU memory, prepared launches, compiles and the host cost per call reported,
and every bound checked.

    python benchmarks/soak.py [--calls 100000] [--seed 0] [--json soak.json]

The trace: decode steps (70% of calls) of a batch of 1-256 sequences (log-uniform), one token each
over a paged cache of 16- or 128-token pages, contexts up to 2k, 8k or 32k, the page table and
seqused_k new every step; prefill mixes (20%) of 1-32 packed sequences of up to 4096 tokens
(log-uniform); chunked prefill (10%) of 1-8 chunks of up to 512 tokens over contexts of up to 4k
or 8k in the paged cache. Head dim 128, 32 query heads over 8 K/V heads, bf16. The
cache is allocated once per page size; q, the index tensors and the outputs per call, as a serving
engine makes them.

The warm-up, as a server's start-up runs its batch sizes once, makes the first call of every shape
class of the trace: a decode batch size, page size and context; a prefill's or chunked prefill's
sequence count with its token total and longest sequence rounded up to powers of two (the rounding
fa4tune keys prepared launches and lookups by). The soak is then the whole trace. Reported: host
RSS and GPU memory (allocated and reserved) at the start and the end, the prepared launches kept
(fa4tune keeps the most recently used, up to MAX_PREPARED) and those prepared during the soak, the
kernels compiled after the warm-up (must be none), and the p50 and p99 host time of a call (from
the call to its return, the launch enqueued; the GPU is synchronised every 200 calls, outside the
timed calls), for decode and prefill calls apart. Bounds (exit status 1 if one fails): no compile
and no launch prepared after the warm-up (none dropped and prepared again); prepared launches at
most MAX_PREPARED; GPU memory allocated at the end within 64 MiB of the start; host RSS within
256 MiB of the start."""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADS_Q, HEADS_KV, DIM = 32, 8, 128
MAX_CONTEXT = 32768
PAGE_SIZES = (16, 128)
CACHE_TOKENS = 2**21  # per page size: 2M tokens of K and V (8 GiB), 16 GiB in all
SYNC_EVERY = 200


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def trace(rng: random.Random, calls: int):
    """The calls of the trace: (kind, parameters)."""
    for _ in range(calls):
        x = rng.random()
        if x < 0.7:
            yield (
                "decode",
                {
                    "batch": log_uniform(rng, 1, 256),
                    "page": rng.choice(PAGE_SIZES),
                    "max_context": rng.choice((2048, 8192, MAX_CONTEXT)),
                },
            )
        elif x < 0.9:
            yield "prefill", {"lengths": [log_uniform(rng, 16, 4096) for _ in
                                          range(log_uniform(rng, 1, 32))]}  # fmt: skip
        else:
            yield (
                "chunked",
                {
                    "chunks": [log_uniform(rng, 16, 512) for _ in range(rng.randint(1, 8))],
                    "page": rng.choice(PAGE_SIZES),
                    "max_context": rng.choice((4096, 8192)),
                },
            )


class Cache:
    """A paged KV cache of one page size, and the page tables and lengths of calls over it (made on
    the device, as a serving engine's scheduler writes them: the soak does not check results, so
    the pages of a table need not be distinct)."""

    def __init__(self, page: int, torch) -> None:
        self.page, self.torch = page, torch
        self.pages = CACHE_TOKENS // page
        self.k = torch.randn(self.pages, page, HEADS_KV, DIM, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn_like(self.k)

    def tables(self, batch: int, max_context: int, floor=None):
        """A page table (batch, pages of max_context) and seqused_k in [1, max_context] (at least
        `floor`, a tensor, where given)."""
        torch = self.torch
        width = -(-max_context // self.page)
        table = torch.randint(0, self.pages, (batch, width), device="cuda", dtype=torch.int32)
        used = torch.randint(1, max_context + 1, (batch,), device="cuda", dtype=torch.int32)
        if floor is not None:
            used = torch.maximum(used, floor)
        return table, used


def make_call(kind: str, params: dict, caches: dict, torch):
    """The arguments of one attention_varlen call."""
    bf16 = torch.bfloat16
    if kind == "decode":
        batch, cache = params["batch"], caches[params["page"]]
        table, used = cache.tables(batch, params["max_context"])
        q = torch.randn(batch, 1, HEADS_Q, DIM, device="cuda", dtype=bf16)
        return (q, cache.k, cache.v), {
            "seqused_k": used,
            "page_table": table,
            "max_seqlen_k": params["max_context"],
        }
    if kind == "prefill":
        lengths = params["lengths"]
        cu = torch.tensor([0, *_cumsum(lengths)], dtype=torch.int32, device="cuda")
        total = sum(lengths)
        q, k, v = (
            torch.randn(total, h, DIM, device="cuda", dtype=bf16)
            for h in (HEADS_Q, HEADS_KV, HEADS_KV)
        )
        return (q, k, v, cu, cu, max(lengths), max(lengths)), {"causal": True}
    chunks, cache = params["chunks"], caches[params["page"]]
    cu = torch.tensor([0, *_cumsum(chunks)], dtype=torch.int32, device="cuda")
    chunk_lengths = torch.tensor(chunks, dtype=torch.int32, device="cuda")
    table, used = cache.tables(len(chunks), params["max_context"], floor=chunk_lengths)
    q = torch.randn(sum(chunks), HEADS_Q, DIM, device="cuda", dtype=bf16)
    return (q, cache.k, cache.v, cu, None, max(chunks), params["max_context"]), {
        "seqused_k": used,
        "page_table": table,
        "causal": True,
    }


def shape_class(kind: str, params: dict) -> tuple:
    """What of a call's shapes selects its kernel and prepared launch (the warm-up makes one call
    of each): sizes, with token totals and the longest sequence as powers of two."""
    from fa4tune.runtime.dispatch import rows_class

    if kind == "decode":
        return kind, params["batch"], params["page"], params["max_context"]
    lengths = params["lengths"] if kind == "prefill" else params["chunks"]
    sizes = (len(lengths), rows_class(sum(lengths)), rows_class(max(lengths)))
    if kind == "prefill":
        return (kind, *sizes)
    return (kind, *sizes, params["page"], params["max_context"])


def _cumsum(values):
    total, out = 0, []
    for v in values:
        total += v
        out.append(total)
    return out


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def snapshot(torch, dispatch, compile_module) -> dict:
    torch.cuda.synchronize()
    return {
        "rss_mib": rss_mib(),
        "gpu_allocated_mib": torch.cuda.memory_allocated() / 2**20,
        "gpu_reserved_mib": torch.cuda.memory_reserved() / 2**20,
        "prepared_launches": len(dispatch._LAUNCHES),
        "launches_prepared_so_far": dispatch._LAUNCHES.prepared,
        "compiled_kernels": len(compile_module._CACHE),
    }


def run(calls, caches, torch, attention_varlen, timings=None):
    for index, (kind, params) in enumerate(calls):
        args, kwargs = make_call(kind, params, caches, torch)
        start = time.perf_counter()
        attention_varlen(*args, **kwargs)
        spent = time.perf_counter() - start
        if timings is not None:
            timings["decode" if kind == "decode" else "prefill"].append(spent * 1e6)
        if index % SYNC_EVERY == SYNC_EVERY - 1:
            torch.cuda.synchronize()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/soak.py needs an NVIDIA GPU", file=sys.stderr)
        return 2
    import fa4tune
    from fa4tune.kernels.fa4_fwd_sm90 import compile as compile_module
    from fa4tune.runtime import dispatch

    caches = {page: Cache(page, torch) for page in PAGE_SIZES}
    calls = list(trace(random.Random(args.seed), args.calls))
    # Warm-up: the first call of each shape class compiles and prepares what the trace needs.
    firsts = {}
    for call in calls:
        firsts.setdefault(shape_class(*call), call)
    run(list(firsts.values()), caches, torch, fa4tune.attention_varlen)
    start = snapshot(torch, dispatch, compile_module)
    timings = {"decode": [], "prefill": []}
    began = time.perf_counter()
    run(calls, caches, torch, fa4tune.attention_varlen, timings)
    end = snapshot(torch, dispatch, compile_module)
    wall = time.perf_counter() - began

    def pct(values, q):
        return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else float("nan")

    cost = {kind: {"calls": len(v), "p50_us": pct(v, 50), "p99_us": pct(v, 99)}
            for kind, v in timings.items()}  # fmt: skip
    bounds = {
        "no compile after the warm-up": end["compiled_kernels"] == start["compiled_kernels"],
        "no launch prepared after the warm-up": (
            end["launches_prepared_so_far"] == start["launches_prepared_so_far"]
        ),
        "prepared launches <= MAX_PREPARED": end["prepared_launches"] <= dispatch.MAX_PREPARED,
        "GPU allocated within 64 MiB": end["gpu_allocated_mib"] - start["gpu_allocated_mib"] <= 64,
        "host RSS within 256 MiB": end["rss_mib"] - start["rss_mib"] <= 256,
    }
    result = {"calls": args.calls, "warmup_calls": len(firsts), "wall_s": wall, "start": start,
              "end": end, "cost": cost, "bounds": bounds,
              "max_prepared": dispatch.MAX_PREPARED}  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"{args.calls} calls in {wall:.1f} s, after a warm-up of {len(firsts)} calls")
    print("| | start | end |\n|---|---|---|")
    for name in start:
        print(f"| {name} | {start[name]:.1f} | {end[name]:.1f} |")
    print("| calls | host p50 µs | host p99 µs |\n|---|---|---|")
    for kind, c in cost.items():
        print(f"| {kind} ({c['calls']}) | {c['p50_us']:.1f} | {c['p99_us']:.1f} |")
    for name, ok in bounds.items():
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return 0 if all(bounds.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
