"""Online softmax in registers for the Hopper forward kernel.

Each consumer thread holds two rows of every 64-row wgmma tile, each row spread over the four
threads of a quad. The running max is reduced across the quad at every step; the running sum is kept
per thread and reduced once, at the end.

Conditional rescaling: the max used for the exponentials is only moved (and O and the sum rescaled)
when the new row max exceeds it by more than `rescale_threshold` (log2 units, after the softmax
scale). Otherwise the stale max stays and P values may reach 2^threshold, which fp32 sums and bf16 P
carry without loss. The final normalisation divides by the sum taken against that same max, so the
output is exact whatever the threshold.

With `rescale_branch` a warp skips the O rescale when none of its rows moved its max (a vote and a
branch); without, O is always multiplied (by 1.0 for the rows that kept their max), which costs the
multiplies but leaves the compiler one straight block to schedule the softmax in.

Lazy max (`step_lazy`): the max only has to bound P, so after a tile's first block the exponentials
are taken against the running max straight away, without the block's row max (one FMNMX per score
and two shuffles per row fewer). Every P is at most its thread's row sum (all P are non-negative:
MUFU exponentials only, the kernel refuses emulated ones here, whose polynomial is wrong past
2^127), so while no sum exceeds 2^threshold no P does, and the step is exactly the one that keeps
the max. A warp with a sum above that takes the max from P (its log2 is how far the max rose) and
rescales where it rose past the threshold. A rise past 125 in log2 units (whose factor 2^-rise would
flush to zero, or whose P or sum overflowed) or a NaN sum leaves nothing to rescale by: then the
warp asks its caller to recompute the scores and takes the exact step.
"""

from __future__ import annotations

import copy
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .exp2 import emulated_columns, exp2_emulated, exp2_mufu
from .helpers import acc_rows_cols

LN2 = math.log(2.0)


def quad_allreduce(value: Float32, op) -> Float32:
    """Reduce across the four threads that share a row (lanes differing in their two low bits)."""
    for offset in (1, 2):
        value = op(value, cute.arch.shuffle_sync_bfly(value, offset=offset))
    return value


class OnlineSoftmax:
    def __init__(
        self,
        scale_log2: Float32,
        num_rows: int,
        rescale_threshold: float,
        emu_share: float,
        poly_degree: int,
        rescale_branch: bool = True,
    ):
        self.scale_log2 = scale_log2
        self.num_rows = num_rows
        self.rescale_threshold = rescale_threshold
        self.emu_share = emu_share
        self.poly_degree = poly_degree
        self.rescale_branch = rescale_branch
        self.row_max = cute.make_rmem_tensor(num_rows, Float32)
        self.row_sum = cute.make_rmem_tensor(num_rows, Float32)

    # The DSL carries objects through run-time control flow by their MLIR values: these fields are
    # run-time values, the others compile-time constants.
    _RUNTIME_FIELDS = ("scale_log2", "row_max", "row_sum")

    def __extract_mlir_values__(self):
        values, self._value_counts = [], []
        for name in self._RUNTIME_FIELDS:
            field_values = cutlass.extract_mlir_values(getattr(self, name))
            values += field_values
            self._value_counts.append(len(field_values))
        return values

    def __new_from_mlir_values__(self, values):
        rebuilt = copy.copy(self)
        pos = 0
        for name, count in zip(self._RUNTIME_FIELDS, self._value_counts):
            setattr(
                rebuilt,
                name,
                cutlass.new_from_mlir_values(getattr(self, name), values[pos : pos + count]),
            )
            pos += count
        return rebuilt

    def reset(self) -> None:
        self.row_max.fill(-Float32.inf)
        self.row_sum.fill(0.0)

    def _row_max_local(self, row: cute.Tensor, ncols: int) -> Float32:
        # Four independent chains keep the FMNMX latency off the critical path.
        chains = [row[c] for c in range(min(4, ncols))]
        for c in range(len(chains), ncols):
            chains[c % 4] = cute.arch.fmax(chains[c % 4], row[c])
        while len(chains) > 1:
            chains = [
                cute.arch.fmax(chains[i], chains[i + 1]) if i + 1 < len(chains) else chains[i]
                for i in range(0, len(chains), 2)
            ]
        return chains[0]

    @cute.jit
    def step(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool], row_scale: cute.Tensor):
        """Turn scores into unnormalised probabilities in place; write each row's O rescale factor
        (1.0 where the max was kept) into row_scale."""
        self._exact_step(acc_S, is_first, row_scale, self.row_max, self.row_sum)

    # The state tensors are parameters, not self's fields, so that the lazy step can take this step
    # inside a run-time branch through names of its own (written through self's fields there, the
    # kernel did not build: a value created in the branch was used outside it).
    @cute.jit
    def _exact_step(
        self,
        acc_S: cute.Tensor,
        is_first: cutlass.Constexpr[bool],
        row_scale: cute.Tensor,
        row_max_of: cute.Tensor,
        row_sum_of: cute.Tensor,
    ):
        scores = acc_rows_cols(acc_S)
        ncols = cute.size(scores, mode=[1])
        emulate = emulated_columns(ncols, self.emu_share)
        for r in cutlass.range_constexpr(self.num_rows):
            row = scores[r, None]
            seen = quad_allreduce(self._row_max_local(row, ncols), cute.arch.fmax)
            if cutlass.const_expr(is_first):
                row_max = seen
                row_scale[r] = 1.0
            else:
                old = row_max_of[r]
                candidate = cute.arch.fmax(old, seen)
                # A rise from -inf (nothing seen yet) always moves the max; -inf to -inf gives NaN,
                # which compares false and keeps it.
                if cutlass.const_expr(self.rescale_threshold == 0.0):
                    move = candidate > old
                else:
                    move = (candidate - old) * self.scale_log2 > self.rescale_threshold
                row_max = old
                scale = Float32(1.0)
                if move:
                    scale = exp2_mufu((old - candidate) * self.scale_log2)
                    row_max = candidate
                row_scale[r] = scale
            row_max_of[r] = row_max
            # A row that has seen only -inf scores subtracts 0 so exp2 gives 0, not NaN.
            max_scaled = (row_max if row_max != -Float32.inf else Float32(0.0)) * self.scale_log2
            partial = self._exponentiate(row, max_scaled, emulate)
            if cutlass.const_expr(is_first):
                row_sum_of[r] = partial
            else:
                row_sum_of[r] = row_sum_of[r] * row_scale[r] + partial

    def _exponentiate(self, row: cute.Tensor, max_scaled: Float32, emulate: tuple) -> Float32:
        """row = 2^(row * scale - max_scaled) in place; returns the thread's sum of the row."""
        # Four partial sums: a single running sum would chain every FADD on the previous one.
        sums = []
        for c in range(len(emulate)):
            x = row[c] * self.scale_log2 - max_scaled
            p = exp2_emulated(x, self.poly_degree) if emulate[c] else exp2_mufu(x)
            row[c] = p
            if c < 4:
                sums.append(p)
            else:
                sums[c % 4] = sums[c % 4] + p
        while len(sums) > 1:
            sums = [sums[i] + sums[i + 1] for i in range(0, len(sums) - 1, 2)] + (
                [sums[-1]] if len(sums) % 2 else []
            )
        return sums[0]

    @cute.jit
    def step_lazy(self, acc_S: cute.Tensor, row_scale: cute.Tensor) -> cutlass.Boolean:
        """A block after the tile's first (see the module docstring): like step(acc_S, False,
        row_scale), but the row max is taken only where the row sums show a rise. Returns whether
        the warp must recompute its scores and take step() instead (a rise too far to rescale by, or
        a NaN sum: see _settle_from_p); the state is then as it was before the call.
        Warp-uniform."""
        scores = acc_rows_cols(acc_S)
        ncols = cute.size(scores, mode=[1])
        emulate = emulated_columns(ncols, self.emu_share)
        row_max, row_sum = self.row_max, self.row_sum  # local names: written in the branches below
        # A row without a finite max yet (causal rows above the diagonal so far) has no reference to
        # exponentiate against: its warp takes the exact step, on the scores, which are still
        # intact.
        unset = row_max[0] == -Float32.inf
        for r in cutlass.range_constexpr(1, self.num_rows):
            unset = unset | (row_max[r] == -Float32.inf)
        recompute = cutlass.Boolean(False)
        partial = cute.make_rmem_tensor(self.num_rows, Float32)
        limit = Float32(2.0**self.rescale_threshold)
        high = cutlass.Boolean(False)
        if cute.arch.vote_any_sync(unset):
            self._exact_step(acc_S, False, row_scale, row_max, row_sum)
        else:
            for r in cutlass.range_constexpr(self.num_rows):
                partial[r] = self._exponentiate(
                    scores[r, None], row_max[r] * self.scale_log2, emulate
                )
                # A NaN sum (NaN scores) leaves the fast path as well.
                high = high | (partial[r] > limit) | (partial[r] != partial[r])
            if cute.arch.vote_any_sync(high):
                recompute = self._settle_from_p(scores, partial, row_scale, limit, row_max, row_sum)
            else:
                for r in cutlass.range_constexpr(self.num_rows):
                    row_scale[r] = 1.0
                    row_sum[r] = row_sum[r] + partial[r]
        return recompute

    @cute.jit
    def _settle_from_p(
        self,
        scores: cute.Tensor,
        partial: cute.Tensor,
        row_scale: cute.Tensor,
        limit: Float32,
        row_max: cute.Tensor,
        row_sum: cute.Tensor,
    ) -> cutlass.Boolean:
        """The slow path of step_lazy: a row's largest P is 2 to the power of how far its max rose
        (quad-reduced, so the four threads of a row agree). Rows past the limit move their max
        there, and P, the row sum and (through row_scale) O follow; the others keep it. Returns
        whether a row rose too far for that (past 2^125, where the factor would flush to zero, or a
        P or a thread's sum overflowed) or a sum is NaN, leaving the state untouched then."""
        ncols = cute.size(scores, mode=[1])
        p_max = cute.make_rmem_tensor(self.num_rows, Float32)
        overflow = cutlass.Boolean(False)
        for r in cutlass.range_constexpr(self.num_rows):
            p_max[r] = quad_allreduce(self._row_max_local(scores[r, None], ncols), cute.arch.fmax)
            # Past 2^125 (inf included) the factor 1/p_max would flush to zero (the MUFU's exp2 is
            # ftz); and the sum, not only the max: finite P near 2^128 can sum to inf, and the max
            # drops NaN.
            overflow = (
                overflow
                | (p_max[r] > Float32(2.0**125))
                | (partial[r] == Float32.inf)
                | (partial[r] != partial[r])
            )
        recompute = cute.arch.vote_any_sync(overflow)
        if not recompute:
            for r in cutlass.range_constexpr(self.num_rows):
                scale = Float32(1.0)
                if p_max[r] > limit:
                    old = row_max[r]
                    candidate = old + cute.math.log2(p_max[r], fastmath=True) / self.scale_log2
                    # One factor for P, the row sum and O, so that the three stay consistent.
                    scale = exp2_mufu((old - candidate) * self.scale_log2)
                    row_max[r] = candidate
                    for c in cutlass.range_constexpr(ncols):
                        scores[r, c] = scores[r, c] * scale
                row_scale[r] = scale
                row_sum[r] = (row_sum[r] + partial[r]) * scale
        return recompute

    @cute.jit
    def rescale(self, acc_O: cute.Tensor, row_scale: cute.Tensor):
        """O rows *= row_scale; with rescale_branch, skipped if no row of the warp moved its max."""
        if cutlass.const_expr(self.rescale_branch):
            moved = row_scale[0] != 1.0
            for r in cutlass.range_constexpr(1, self.num_rows):
                moved = moved | (row_scale[r] != 1.0)
            if cute.arch.vote_any_sync(moved):
                self._scale_rows(acc_O, row_scale)
        else:
            self._scale_rows(acc_O, row_scale)

    def _scale_rows(self, acc_O: cute.Tensor, row_scale: cute.Tensor):
        out = acc_rows_cols(acc_O)
        # Plain Python loops, unrolled at trace time (this helper is not @cute.jit, on purpose: a
        # staged loop here would index the accumulator fragment at run time).
        for r in range(self.num_rows):
            for c in range(cute.size(out, mode=[1])):
                out[r, c] = out[r, c] * row_scale[r]

    @cute.jit
    def finalize(self, acc_O: cute.Tensor, lse: cute.Tensor):
        """Normalise O by the row sums and write the natural-log LSE per row. Rows that saw no key
        (everything masked) give O = 0 and LSE = -inf."""
        out = acc_rows_cols(acc_O)
        for r in cutlass.range_constexpr(self.num_rows):
            total = quad_allreduce(self.row_sum[r], lambda a, b: a + b)
            seen_any = self.row_max[r] != -Float32.inf
            inv = Float32(0.0)
            row_lse = -Float32.inf
            if seen_any:
                inv = cute.arch.rcp_approx(total)
                row_lse = (
                    self.row_max[r] * self.scale_log2 + cute.math.log2(total, fastmath=True)
                ) * LN2
            lse[r] = row_lse
            for c in cutlass.range_constexpr(cute.size(out, mode=[1])):
                out[r, c] = out[r, c] * inv
