"""The backward's CTA order, modeled on the CPU: how close to the ideal the CTAs of each causal
problem of the training job finish, in the grid's plain order (K blocks fastest) and in the order
of sections of K/V heads that the kernel runs (`kernel.cta_coords`, `launch.heads_per_section`).

    python benchmarks/cta_order.py [--job tuning_configs/h200-bf16-train.yaml]

The model: every SM holds one CTA at a time (the backward's shared memory allows no second) and
takes the next CTA in launch order when its CTA ends (list scheduling, as the GPU's block
scheduler starts CTAs in linear grid order); a CTA costs its steps (Q blocks it walks x the query
heads of its group) plus `--fixed` steps (K and V in, dK and dV out, the pipeline's fill), every
step the same time. Efficiency = (all CTAs' cost / SMs) / the time the last CTA ends. It leaves
out what the order changes in the L2 (the sections are sized to keep a head's shared rows there)
and the masked steps' extra cost: a bound on what the order can move, measured on the GPU."""

from __future__ import annotations

import argparse
import heapq
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fa4tune.kernels.common.dsl import import_dsl  # noqa: E402
from fa4tune.kernels.fa4_bwd_sm90.config import default_config  # noqa: E402
from fa4tune.kernels.fa4_bwd_sm90.launch import heads_per_section  # noqa: E402
from fa4tune.target import get_target  # noqa: E402
from fa4tune.tune.job import load_job  # noqa: E402


def walk_steps(problem, config, n_block: int) -> int:
    """Steps of the CTA of K block n_block: the Q blocks whose queries see one of its keys
    (bottom-right causal), times the query heads of the group."""
    m_blocks = -(-problem.seqlen_q // config.tile_m)
    first_key = n_block * config.tile_n
    offset = problem.seqlen_k - problem.seqlen_q
    first = max(0, (first_key - offset) // config.tile_m) if problem.causal else 0
    return max(0, m_blocks - first) * problem.qheads_per_kvhead


def finish_time(costs: list[float], sms: int) -> float:
    """When the last CTA ends, the CTAs started in order on the first free SM."""
    free = [0.0] * sms
    end = 0.0
    for cost in costs:
        start = heapq.heappop(free)
        end = max(end, start + cost)
        heapq.heappush(free, start + cost)
    return end


def efficiency(problem, config, section: int, target, fixed: float) -> float:
    """Modeled efficiency of the launch order with `section` K/V heads per section."""
    import_dsl(target)  # kernel.py imports the DSL, whose first import fixes the arch
    from fa4tune.kernels.fa4_bwd_sm90.kernel import cta_coords

    x_blocks = -(-problem.seqlen_k // config.tile_n)
    log2 = section.bit_length() - 1
    costs = []
    for bz in range(problem.batch):
        for by in range(problem.nheads_kv // section):
            for bx in range(x_blocks * section):
                n_block, _, _ = cta_coords(bx, by, bz, log2)
                costs.append(walk_steps(problem, config, n_block) + fixed)
    return sum(costs) / target.sm_count / finish_time(costs, target.sm_count)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", default="tuning_configs/h200-bf16-train.yaml")
    parser.add_argument("--fixed", type=float, default=2.0, help="a CTA's fixed cost, in steps")
    args = parser.parse_args(argv)
    job = load_job(args.job)
    target = get_target(job.target)
    print(f"# {target.name}: {target.sm_count} SMs, one CTA each; fixed cost {args.fixed} steps")
    print("| problem | config | heads per section | plain order | sections | gain |")
    print("|---|---|---|---|---|---|")
    for problem in job.problems:
        if not problem.causal:
            continue
        config = default_config(problem, target)
        section = heads_per_section(problem, config, target)
        plain = efficiency(problem, config, 1, target, args.fixed)
        ordered = efficiency(problem, config, section, target, args.fixed)
        print(
            f"| {problem.key()} | {config.short()} | {section} | {plain:.3f} | {ordered:.3f} "
            f"| {ordered / plain:.3f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
