"""A first, uncalibrated cost model of the backward kernel, for searches without a GPU (the `model`
backend): the five GEMMs' FLOPs (2.5x the forward's) at a tensor efficiency that grows with the
work per CTA step, the CTAs in waves over the SMs, the dQ accumulator's traffic (every K block adds
its Q blocks' dQ into fp32 in L2), and the preparation around the kernel (LSE2, D, dQ) through HBM.
Its efficiencies are guesses until a GPU run calibrates them (docs/backward-report.md); it ranks
configs, its absolute times are estimates."""

from __future__ import annotations

import math

# Tensor-pipe efficiency of a step: the softmax gradient and the dQ adds between the GEMMs cost
# more with fewer Q rows per step and fewer warpgroups to overlap them.
EFFICIENCY = {(64, 128): 0.62, (64, 64): 0.45, (128, 128): 0.66, (128, 64): 0.5}
DETERMINISTIC_COST = 1.08  # dQ adds wait their turn
L2_ATOMIC_BYTES_PER_S = 2.5e12  # red.global.add.f32 throughput in L2, a guess


class BackwardCostModel:
    def __init__(self, target) -> None:
        self.target = target

    def provenance(self) -> dict:
        return {"model": "fa4_bwd_sm90 analytic, uncalibrated", "target": self.target.name}

    def time_s(self, config, problem) -> tuple[float, dict]:
        t = self.target
        flops = 2.5 * problem.flops  # the five GEMMs against the forward's two
        efficiency = EFFICIENCY[(config.tile_m, config.tile_n)]
        if config.num_stages == 1:
            efficiency *= 0.9
        ctas = problem.batch * problem.nheads_kv * math.ceil(problem.seqlen_k / config.tile_n)
        waves = math.ceil(ctas / t.sm_count)
        fill = ctas / (waves * t.sm_count)
        rate = t.peak_tensor_tflops * 1e12 * efficiency * fill
        compute = flops / rate
        if config.deterministic:
            compute *= DETERMINISTIC_COST
        blocks_k = math.ceil(problem.seqlen_k / config.tile_n)
        causal_share = 0.5 if problem.causal else 1.0
        dq_bytes = (
            4 * problem.batch * problem.nheads_q * problem.seqlen_q * problem.head_dim
        ) * max(1.0, blocks_k * causal_share)
        atomics = dq_bytes / L2_ATOMIC_BYTES_PER_S
        rows = problem.batch * problem.nheads_q * problem.seqlen_q
        prep = (
            4 * rows * problem.head_dim * 2 + 3 * rows * problem.head_dim * 4
        ) / t.hbm_bytes_per_s
        total = max(compute, atomics) + prep
        return total, {
            "compute_ms": compute * 1e3,
            "dq_adds_ms": atomics * 1e3,
            "prep_ms": prep * 1e3,
        }
