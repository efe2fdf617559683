"""Prints what fa4tune.lookup costs per call: \
the first call for a problem (climbing the ladder over a
table of tuned problems) and every later call (a dict hit). Prints numbers; never passes or fails.

    python benchmarks/lookup_overhead.py [--entries 200]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from pathlib import Path

from fa4tune.best import BestEntry
from fa4tune.kernels import get_kernel
from fa4tune.problem import Problem
from fa4tune.runtime.lookup import Lookup
from fa4tune.runtime.tables import render_yaml, table_document


def synthetic_table(path: Path, count: int) -> list[Problem]:
    kernel = get_kernel()
    grid = itertools.product(
        (64, 128),
        (False, True),
        (512, 1024, 2048, 4096, 8192, 16384, 32768),
        (1, 2, 4, 8, 16),
        (8, 16, 32),
    )
    problems = [
        Problem(head_dim=d, causal=c, seqlen_q=s, batch=b, nheads_q=h) for d, c, s, b, h in grid
    ][:count]
    entries = [
        BestEntry(
            kernel=kernel.name,
            kernel_hash=kernel.source_hash(),
            target="H200",
            problem=p.to_dict(),
            problem_key=p.key(),
            bucket_key=p.bucket().key(),
            config=kernel.default_config(p, None).to_dict(),
            time_ms=1.0,
            tflops=1.0,
            is_estimate=True,
            provenance={},
            source="benchmark",
        )
        for p in problems
    ]
    path.write_text(render_yaml(table_document(entries, kernel.name, kernel.source_hash(), "H200")))
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=200)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "table.yaml"
        tuned = synthetic_table(table, args.entries)
        lookup = Lookup(table)
        start = time.perf_counter()
        lookup.index()
        load_s = time.perf_counter() - start

        queries = [
            Problem(
                head_dim=p.head_dim,
                causal=p.causal,
                seqlen_q=p.seqlen_q * 3 // 2,
                batch=p.batch,
                nheads_q=p.nheads_q,
            )
            for p in tuned
        ]
        start = time.perf_counter()
        for q in queries:
            lookup(q, "H200")
        first_us = (time.perf_counter() - start) / len(queries) * 1e6

        hot = queries[0]
        start = time.perf_counter()
        for _ in range(args.calls):
            lookup(hot, "H200")
        hot_us = (time.perf_counter() - start) / args.calls * 1e6
    print(f"table of {len(tuned)} tuned problems: load {load_s * 1e3:.1f} ms (once per process)")
    print(f"first lookup of a problem (ladder climb): {first_us:.1f} us")
    print(f"repeated lookup (cached):                 {hot_us:.2f} us")


if __name__ == "__main__":
    main()
