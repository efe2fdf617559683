"""The backward kernel's cost model, for searches without a GPU (the `model` backend): the five
GEMMs' FLOPs (2.5x the forward's) at a tensor efficiency of the config's tiles and dQ path, the
CTAs in waves over the SMs with a fixed cost per wave (K/V in, dK/dV out, the pipeline's fill),
and the preparation around the kernel (LSE2, D, dQ's fp32 accumulator) through HBM.

Calibrated on the H200 (session 39, docs/kernel-notes.md): 56 measurements of 12 configs on the
training grid (the 15 problems' default and deterministic columns of docs/backward-report.md and
the probe of 7 configs at head dims 64 and 128); the fit's RMS error 5.5%, its largest 22-25% (GQA
4:1 causal, which the model puts at MHA's efficiency; measured 12% below). Configs the fit had no
measurement of take ratios measured in earlier sessions (the register adds, one dS^T buffer) or
guessed (64-key tiles, one stage): it ranks configs; its absolute times are estimates."""

from __future__ import annotations

import math

# Tensor-pipe efficiency of a CTA step at head dim 128 with dQ's TMA reductions from a consumer
# warp and two dS^T buffers, by (tile_m, tile_n). 64-key tiles (one consumer warpgroup): the
# ratio to 128 keys of the first, uncalibrated model (no recent measurement). 80 rows (dq_swap,
# head dim 128): a guess, 5% over 64 rows for the 6.7% fewer instructions per element of its
# static count (docs/kernel-notes.md, session 40; not measured); the swap at 64 rows as without.
EFFICIENCY = {
    (64, 128): 0.5615,
    (128, 128): 0.6555,
    (64, 64): 0.408,
    (128, 64): 0.497,
    (80, 128): 0.59,
}
# Smaller head dims do fewer FLOPs per score between the same elementwise work: efficiency scales
# with d / (d + HEAD_DIM_KNEE), relative to head dim 128.
HEAD_DIM_KNEE = 71.9
DQ_WARP = 1.111  # the dQ warp issuing the reductions (measured 1.06-1.14x)
REGISTER_ADDS = 0.87  # dQ by red.global from registers (TMA 1.08-1.25x that, sessions 37-38)
ONE_DS_BUFFER = 0.99  # two dS^T buffers +0.5-1.8% (session 38)
ONE_STAGE = 0.9  # a guess
QUERY_HALVES = 1.041  # S^T and dP^T in halves (1.027-1.058x on six hd64 shapes, H100, session 48)
# By head dim, the geomean over its six grid shapes (H100 SXM); other head dims as without.
DQ_SINGLE = {64: 0.999, 96: 1.043}  # dQ in the first warpgroup (session 51)
# dQ staged in fragment order (session 52); at head dim 128 unswapped with it tied the swapped dQ,
# which the model rates as unswapped
DQ_FLAT = {64: 1.065, 96: 1.050}
# The deterministic mode's efficiency: with the dQ warp taking the turn (non-causal, causal), else
# the register adds in turn (0.59 of the TMA path, causal or not).
DETERMINISTIC_WARP = (0.875, 0.881)
DETERMINISTIC_REGISTERS = 0.591
PREP_SCALE = 1.46  # of the preparation's bytes at the HBM rate
WAVE_SECONDS = 3.25e-6  # each wave of CTAs: K/V loaded, dK/dV stored, the pipeline filled
# persistent: a walk's launch and first Q/dO loads hide under the last walk (K/V still wait for
# its dK/dV stores). The share of the waves' fixed cost it leaves, from the H200's train search
# (session 57): its time saved over the default at hd64 1k causal, 1k, 4k causal and hd128 1k
# causal (1.042, 1.021, 1.023, 1.019x) takes 0.16-0.30 of the waves' modelled cost off, leaving
# 0.70-0.84; 0.8 their middle
PERSISTENT_WAVE = 0.8


def efficiency(config, problem) -> float:
    d = problem.head_dim
    eff = EFFICIENCY[(config.tile_m, config.tile_n)]
    eff *= (d / (d + HEAD_DIM_KNEE)) / (128 / (128 + HEAD_DIM_KNEE))
    if config.deterministic:
        if config.dq_warp:
            eff *= DQ_WARP * DETERMINISTIC_WARP[problem.causal]
        else:
            eff *= DETERMINISTIC_REGISTERS
    elif config.dq_warp:
        eff *= DQ_WARP
    elif not config.dq_tma:
        eff *= REGISTER_ADDS
    if config.ds_stages == 1:
        eff *= ONE_DS_BUFFER
    if config.num_stages == 1:
        eff *= ONE_STAGE
    if config.q_halves:
        eff *= QUERY_HALVES
    if config.dq_single:
        eff *= DQ_SINGLE.get(d, 1.0)
    if config.dq_flat:
        eff *= DQ_FLAT.get(d, 1.0)
    return eff


class BackwardCostModel:
    def __init__(self, target) -> None:
        self.target = target

    def provenance(self) -> dict:
        return {
            "model": "fa4_bwd_sm90 analytic, calibrated on the H200",
            "target": self.target.name,
        }

    def time_s(self, config, problem) -> tuple[float, dict]:
        t = self.target
        flops = 2.5 * problem.flops  # the five GEMMs against the forward's two
        ctas = problem.batch * problem.nheads_kv * math.ceil(problem.seqlen_k / config.tile_n)
        waves = math.ceil(ctas / t.sm_count)
        fill = ctas / (waves * t.sm_count)
        rate = t.peak_tensor_tflops * 1e12 * efficiency(config, problem) * fill
        wave = WAVE_SECONDS * (PERSISTENT_WAVE if config.persistent else 1.0)
        compute = flops / rate + waves * wave
        rows = problem.batch * problem.nheads_q * problem.seqlen_q
        prep = (
            PREP_SCALE
            * (4 * rows * problem.head_dim * 2 + 3 * rows * problem.head_dim * 4)
            / t.hbm_bytes_per_s
        )
        return compute + prep, {"compute_ms": compute * 1e3, "prep_ms": prep * 1e3}
