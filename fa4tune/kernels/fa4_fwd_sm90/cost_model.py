"""An analytic cost model of the FA4-style forward kernel on a Target: what the search optimises
when no GPU is present (the `model` backend asks the family for it). Deterministic; every result is
marked as an estimate.

Per K/V step of one CTA (tile_m query rows against tile_n keys) it costs
  - the two GEMMs on the tensor cores (at the target's measured GEMM efficiency, scaled),
  - the softmax side: exponentials on MUFU and everything else on the ALU issue slots, the emulated
    share of exponentials moving from MUFU to FMA issue (calibrated on the design notes' H200
    microbenchmark, plus what an emulated exponential costs in the kernel), the O rescale (skipped
    by rescale_threshold) and causal/ragged masking,
  - the shared-memory operand traffic of the GEMMs, and a fixed handshake cost,
and overlaps the GEMMs with the softmax side (intra-warpgroup overlap and warpgroup ping-pong,
better with more consumer warpgroups). A K/V load starts when its stage is released; further stages
hide its latency. CTAs are scheduled on sm_count × (CTAs per SM) slots (wave quantisation; causal
CTAs longest first), and the kernel can never beat HBM. A persistent kernel pays the CTA start and
the first loads once per SM; later tiles load under their predecessor. Packed GQA makes one tile of
a K/V head's query heads; split-KV shares each tile's K blocks among CTAs and adds the fp32
partials' HBM round trip and the combine kernel's latency. Against session 34's decode measurements
(H200, hdim 128, one query) the model ranks the split counts right but puts one CTA's streaming
rate about 30% low (batch 1 x 8 K/V heads x 131k unsplit: 0.37 TB/s, measured 0.55) and misses
part of a short split's start-up (batch 1 x 32k, 16 splits: 3.5, measured 2.5).

The softmax side's constants come from a microbenchmark (the team's design notes); the others are
fitted to an H200 search's measurements (`fa4tune.kernels.fa4_fwd_sm90.calibrate`, ModelAssumptions
says how well they fit)."""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import asdict, dataclass

from . import resources


@dataclass(frozen=True)
class ModelAssumptions:
    """What the model assumes beyond the Target's numbers; each is calibrated or estimated here."""

    # Softmax side, per score element, measured on an H200 (design notes' microbenchmark):
    # 23.5 elements/clk/SM with no exponential at all -> ALU lane-ops per element =
    # alu_issue_per_clk / 23.5.
    no_exp_elements_per_clk: float = 23.5
    # Lane-ops of one emulated exp2 beyond the polynomial's `degree` FMAs (range split, exponent
    # insert, conversion). With `softmax_pipe_overlap` this reproduces 14.1 elements/clk MUFU-only,
    # 15.2 with 1/8 emulated at degree 3, and MUFU-only winning again from about 30% emulated.
    emulation_extra_ops: float = 3.9
    # MUFU and ALU issue overlap imperfectly: time = max + softmax_pipe_overlap * min.
    softmax_pipe_overlap: float = 0.17
    # The rest is fitted (`fa4tune.kernels.fa4_fwd_sm90.calibrate`, `benchmarks/fit_model.py`) to
    # the 702 candidates of the H200 search of run 10 (the lazy row max in every default;
    # tuning_configs/calibration/h200-run10.json): mean squared log error over problems, TPE then a
    # pattern search. Held out, run 11's 640 candidates (the shipped table's search): RMS log error
    # 0.105 (0.117 with the fit to run 8 before); over the 261 fully timed ones, rank correlation
    # per problem 0.44 (0.43) and the model's first choice 2.7% slower than the best measured, on
    # average (3.4%). Read the values as a fit, not as hardware facts: they trade off against each
    # other, and the tensor scale sits on its bound.
    # GEMMs and softmax combine as an L^p norm (p = 1: no overlap, larger: more), by which of
    # intra-warpgroup overlap and warpgroup ping-pong are on; more consumer warpgroups hide more of
    # the softmax behind the other warpgroups' GEMMs: p grows by the last per warpgroup beyond two.
    overlap_norm_both: float = 2.005
    overlap_norm_one: float = 1.743
    overlap_norm_none: float = 1.508
    overlap_norm_per_extra_warpgroup: float = 0.4461
    # Memory system seen by one SM: TMA load latency and L2->SMEM bandwidth. The fitted bandwidth
    # (6.1 TB/s over 132 SMs) is a floor that hdim 256 beats: the model puts its best config at 1.52
    # ms, measured 1.39 (run 11), and cannot rank the compute knobs of the candidates on that floor.
    load_latency_clk: float = 969.5
    l2_bytes_per_clk_per_sm: float = 25.31
    # Fixed costs: pipeline handshakes per step, block start.
    step_overhead_clk: float = 455.8
    cta_overhead_clk: float = 2335.0
    launch_overhead_us: float = 4.0  # not fitted
    # Split-KV's combine kernel beyond its partials' traffic: not fitted; torch.profiler measured
    # 2.4 µs (4 splits) to 5-6 µs (16 splits) at batch 1 x 32 heads on the H200, launched after
    # the split kernel (session 34); launched as its programmatic dependent, part of that hides.
    combine_us: float = 3.0
    # The in-kernel combine (combine_in_kernel) instead: no second launch; the last split CTA of
    # a tile reads the tile's partials back from L2 while the grid's other CTAs finish. Its merge
    # walks the splits in order, resources.merge_splits_in_flight of them loaded at once (sm90a
    # SASS), so it costs about an L2 round trip (merge_round_trip_us) per that many splits, after
    # a fixed last_cta_combine_us (the count, the fences, the LSE passes). Not measured.
    last_cta_combine_us: float = 0.5
    merge_round_trip_us: float = 0.4
    # Tensor efficiency when the target has no measured GEMM rate: the H200's measured 750 of its
    # 989 TFLOP/s peak (the same SM as the H100's). Not fitted; with the scale below, any value from
    # 0.76 up gives the peak.
    default_tensor_efficiency: float = 0.76
    # Attention's GEMMs against the target's measured (or default) GEMM rate, capped at the peak:
    # the fit took the peak, so every target's GEMMs run at its peak (the 8192^3 GEMM behind the 750
    # runs hotter, at lower clocks; the step overhead above carries the rest).
    tensor_efficiency_scale: float = 1.32
    # Lane-ops one emulated exp2 costs inside the kernel beyond what the microbenchmark above saw
    # (registers and scheduling around the GEMMs): no best config of runs 6 to 11 has an emulated
    # share (in runs 6 and 8 some measured within 3% of the best at hdim 256 and hdim 64 512
    # causal).
    emulation_kernel_extra_ops: float = 13.0
    # With one stage the next K/V load starts only when the stage is released: the share of the
    # load (latency and transfer) that the step then waits for (K and V have separate buffers, so
    # V's load runs under the S GEMM). Each further stage hides one more step's worth.
    single_stage_exposed_fetch: float = 0.3384


def softmax_clocks_per_element(
    target,
    emu_share: float,
    poly_degree: int,
    assumptions: ModelAssumptions = ModelAssumptions(),
    lazy_max: bool = False,
) -> float:
    """SM clocks per score element on the softmax side (max, scale, exp2, sum, pack); with
    `lazy_max` without the max (one FMNMX per element fewer)."""
    a = assumptions
    base_ops = target.alu_issue_per_clk / a.no_exp_elements_per_clk - (1.0 if lazy_max else 0.0)
    mufu = (1.0 - emu_share) / target.mufu_ex2_per_clk
    issue_ops = (
        base_ops + (1.0 - emu_share) * 1.0 + emu_share * (poly_degree + a.emulation_extra_ops)
    )
    issue = issue_ops / target.alu_issue_per_clk
    return max(mufu, issue) + a.softmax_pipe_overlap * min(mufu, issue)


def rescale_fraction(rescale_threshold: float, steps: int) -> float:
    """Share of K/V steps that rescale O. At threshold 0 any rise of any row's max rescales, which
    with 64 rows per warpgroup is nearly every step. Above it, only a jump larger than the threshold
    does: the running max of n blocks rises about 1 + ln n times, and larger jumps are rarer still
    (assumed to halve per 4 units of threshold)."""
    if rescale_threshold <= 0 or steps <= 1:
        return 1.0
    return min(1.0, (1.0 + math.log(steps)) / steps * 2.0 ** (-rescale_threshold / 4.0))


class CostModel:
    def __init__(self, target, assumptions: ModelAssumptions = ModelAssumptions()) -> None:
        self.target = target
        self.assumptions = assumptions

    def provenance(self) -> dict:
        """What a run records of the model: its assumptions."""
        return {"model_assumptions": asdict(self.assumptions)}

    def tensor_efficiency(self) -> float:
        t = self.target
        if t.measured_tensor_tflops:
            efficiency = t.measured_tensor_tflops / t.peak_tensor_tflops
        else:
            efficiency = self.assumptions.default_tensor_efficiency
        return min(1.0, efficiency * self.assumptions.tensor_efficiency_scale)

    def ctas_per_sm(self, config, problem) -> int:
        t = self.target
        by_smem = t.smem_per_sm // max(1, resources.smem_bytes(config, problem))
        wgs = resources.num_consumer_warpgroups(config)
        if wgs in resources.REGISTER_SPLIT:
            producer, consumer = resources.register_split(config)
            by_regs = t.regs_per_sm // (
                resources.THREADS_PER_WARPGROUP * (producer + wgs * consumer)
            )
        else:
            by_regs = 1
        return max(1, min(by_smem, by_regs))

    def step_clocks(
        self, config, problem, ctas_per_sm: int, steps: int, masked: bool, first: bool = False
    ) -> float:
        """SM clocks one K/V step of one CTA takes while `ctas_per_sm` CTAs share the SM. A tile's
        `first` step takes its row max even with `lazy_max` (there is no running max before it), and
        neither votes on nor rescales O (there is nothing in O yet)."""
        t, a = self.target, self.assumptions
        tm, tn, d, dv = config.tile_m, config.tile_n, problem.head_dim, problem.head_dim_v
        tensor = 2.0 * tm * tn * (d + dv) / (t.tensor_flops_per_clk * self.tensor_efficiency())
        elements = tm * tn
        softmax = elements * softmax_clocks_per_element(
            t, config.emu_share, config.poly_degree, a, lazy_max=config.lazy_max and not first
        )
        softmax += elements * config.emu_share * a.emulation_kernel_extra_ops / t.alu_issue_per_clk
        if first:
            pass  # the first step starts O: nothing to vote on or rescale
        elif config.rescale_branch:
            softmax += (
                rescale_fraction(config.rescale_threshold, steps) * tm * dv / t.alu_issue_per_clk
            )
            if config.rescale_threshold > 0:
                softmax += 2.0 * tm / t.alu_issue_per_clk  # the per-row vote on whether to rescale
        else:  # O is multiplied on every later step
            softmax += tm * dv / t.alu_issue_per_clk
        if masked:
            softmax += 2.0 * elements / t.alu_issue_per_clk  # compare and select per element
        # Every consumer warpgroup reads the K and V tiles from shared memory, and Q once per step.
        smem = ((tm // 64) * tn * (d + dv) * 2 + tm * d * 2) / t.smem_bytes_per_clk
        overlaps = int(bool(config.intra_wg_overlap)) + int(
            bool(getattr(config, "wg_pingpong", False))
        )
        p = (a.overlap_norm_none, a.overlap_norm_one, a.overlap_norm_both)[overlaps]
        p += a.overlap_norm_per_extra_warpgroup * max(
            0, resources.num_consumer_warpgroups(config) - 2
        )
        compute = max((tensor**p + softmax**p) ** (1.0 / p), smem) + a.step_overhead_clk
        transfer = tn * (d + dv) * 2 / a.l2_bytes_per_clk_per_sm
        fetch = a.load_latency_clk + transfer
        # A load starts when its stage is released. With one stage the step waits for the share of
        # the load the rest of its own step does not cover; each further stage covers one more step.
        busy = ctas_per_sm * compute
        wait = max(0.0, a.single_stage_exposed_fetch * fetch - (config.num_stages - 1) * busy)
        return max(busy + wait, ctas_per_sm * transfer)

    def start_clocks(self, config, problem) -> float:
        """CTA start, Q's load and the first K/V round trip: once per tile, or once per SM when
        persistent."""
        a = self.assumptions
        prologue = (
            a.load_latency_clk + config.tile_m * problem.head_dim * 2 / a.l2_bytes_per_clk_per_sm
        )
        return a.cta_overhead_clk + prologue + a.load_latency_clk

    def cta_clocks(self, config, problem, ctas_per_sm: int, steps: int, masked_steps: int) -> float:
        t, a = self.target, self.assumptions
        tm, dv = config.tile_m, problem.head_dim_v
        start = 0.0 if config.persistent else self.start_clocks(config, problem)
        epilogue = (
            tm * dv * 2 / a.l2_bytes_per_clk_per_sm + ctas_per_sm * tm * dv / t.alu_issue_per_clk
        )
        if steps == 0:  # no loads: only the CTA start, and only without persistence
            return (0.0 if config.persistent else a.cta_overhead_clk) + epilogue
        # The kernel walks the K/V blocks last first and always masks the first: kv_steps counts it
        # among the masked ones, so masked_steps is at least 1 here.
        plain = self.step_clocks(config, problem, ctas_per_sm, steps, masked=False)
        masked = self.step_clocks(config, problem, ctas_per_sm, steps, masked=True)
        first = self.step_clocks(config, problem, ctas_per_sm, steps, masked=True, first=True)
        return (
            start + first + (steps - masked_steps) * plain + (masked_steps - 1) * masked + epilogue
        )

    def kv_steps(self, config, problem) -> list[tuple[int, int, int]]:
        """(steps, masked steps, number of CTAs) for each distinct kind of CTA. The kernel masks the
        first block it takes (the last one) whether or not it needs it, so every CTA with a step has
        a masked one. With packed GQA a tile's rows are (query, head of the group) pairs, row r
        being query r // group, and there is one row block per K/V head; with split-KV each split
        takes its share of the tile's blocks (split_blocks), and may take none."""
        tm, tn = config.tile_m, config.tile_n
        group = problem.qheads_per_kvhead if config.pack_gqa else 1
        tiles = []  # (blocks, first block that needs the mask, CTAs)
        # Ragged inputs: the sequences of the token mix, each with its own lengths.
        for (seqlen_q, sk), batch in Counter(problem.lengths()).items():
            rows = seqlen_q * group
            m_blocks = -(-rows // tm)
            ctas_per_row_block = batch * (problem.nheads_q // group)
            offset = sk - seqlen_q  # bottom-right aligned causal mask
            if not problem.causal:
                blocks = -(-sk // tn)
                tiles.append((blocks, blocks, m_blocks * ctas_per_row_block))
                continue
            for i in range(m_blocks):
                first_query = i * tm // group
                last_query = (min((i + 1) * tm, rows) - 1) // group
                blocks = -(-min(sk, max(0, last_query + 1 + offset)) // tn)
                unmasked = min(blocks, max(0, first_query + offset + 1) // tn)
                tiles.append((blocks, unmasked, ctas_per_row_block))
        kinds: dict[tuple[int, int], int] = {}
        for blocks, unmasked, count in tiles:
            for lo, hi in split_blocks(blocks, config.num_splits):
                steps = hi - lo
                masked = max(0, hi - max(lo, unmasked))
                kind = (steps, max(masked, 1) if steps else 0)
                kinds[kind] = kinds.get(kind, 0) + count
        return [(steps, masked, count) for (steps, masked), count in kinds.items()]

    def time_s(self, config, problem) -> tuple[float, dict]:
        t, a = self.target, self.assumptions
        k = self.ctas_per_sm(config, problem)
        slots = t.sm_count * k
        kinds = self.kv_steps(config, problem)
        durations = [(self.cta_clocks(config, problem, k, s, m), n) for s, m, n in kinds]
        if len(durations) == 1:
            clocks, count = durations[0]
            waves = -(-count // slots)
            makespan = waves * clocks
        else:
            # Causal tiles longest first, each to the first free slot (persistent CTAs take theirs
            # from the kernel's tile counter, so they fill the slots the same way).
            makespan = _longest_first_makespan(durations, slots)
            waves = None
        if config.persistent:
            makespan += self.start_clocks(config, problem)
        compute_s = makespan / (t.clock_mhz * 1e6)
        hbm_s = problem.bytes_min / t.hbm_bytes_per_s
        total = max(compute_s, hbm_s) + a.launch_overhead_us * 1e-6
        combine_s = self.combine_s(config, problem)
        return total + combine_s, {
            "ctas_per_sm": k,
            "waves": waves,
            "compute_ms": compute_s * 1e3,
            "hbm_ms": hbm_s * 1e3,
            "combine_ms": combine_s * 1e3,
            "bound": "memory" if hbm_s > compute_s else "compute",
        }

    def combine_s(self, config, problem) -> float:
        """Split-KV's cost beyond its CTAs: the fp32 partials (O and LSE of every split) written
        and read back through HBM, and the combine's own latency: the combine kernel's, or with
        combine_in_kernel the last split CTA's merge (no second launch)."""
        splits = config.num_splits
        if splits <= 1:
            return 0.0
        rows = sum(q for q, _ in problem.lengths()) * problem.nheads_q
        partials = splits * rows * (problem.head_dim_v + 1) * 4
        a = self.assumptions
        latency_us = a.combine_us
        if config.combine_in_kernel:
            in_flight = resources.merge_splits_in_flight(config, problem.head_dim_v, problem.layout)
            trips = -(-splits // in_flight)
            latency_us = a.last_cta_combine_us + trips * a.merge_round_trip_us
        return 2 * partials / self.target.hbm_bytes_per_s + latency_us * 1e-6


def split_blocks(blocks: int, splits: int) -> list[tuple[int, int]]:
    """The K block ranges [lo, hi) of a tile's splits, as the kernel takes them
    (kernel.n_block_range): the s-th run of ceil(blocks / splits), empty past the end."""
    per_split = -(-blocks // splits)
    return [(min(blocks, s * per_split), min(blocks, (s + 1) * per_split)) for s in range(splits)]


def _longest_first_makespan(durations: list[tuple[float, int]], slots: int) -> float:
    """Greedy longest-first list scheduling of CTAs (duration, count) on `slots` equal slots."""
    finish = [0.0] * slots
    for duration, count in sorted(durations, key=lambda dc: -dc[0]):
        # Whole rounds at once: `count` CTAs of one duration fill the least-loaded slots in turn.
        rounds, rest = divmod(count, slots)
        if rounds:
            finish = [f + rounds * duration for f in finish]
        if rest:
            heapq.heapify(finish)
            for _ in range(rest):
                heapq.heapreplace(finish, finish[0] + duration)
    return max(finish)
