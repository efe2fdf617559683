"""Online softmax in registers for the Hopper forward kernel.

Each consumer thread holds two rows of every 64-row wgmma tile, each row spread over the four threads
of a quad. The running max is reduced across the quad at every step; the running sum is kept per
thread and reduced once, at the end.

Conditional rescaling: the max used for the exponentials is only moved (and O and the sum rescaled)
when the new row max exceeds it by more than `rescale_threshold` (log2 units, after the softmax scale).
Otherwise the stale max stays and P values may reach 2^threshold, which fp32 sums and bf16 P carry
without loss. The final normalisation divides by the sum taken against that same max, so the output is
exact whatever the threshold.

With `rescale_branch` a warp skips the O rescale when none of its rows moved its max (a vote and a
branch); without, O is always multiplied (by 1.0 for the rows that kept their max), which costs the
multiplies but leaves the compiler one straight block to schedule the softmax in.
"""

from __future__ import annotations

import copy
import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .exp2_device import emulated_columns, exp2_emulated, exp2_mufu
from .sm90_helpers import acc_rows_cols

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
            setattr(rebuilt, name, cutlass.new_from_mlir_values(getattr(self, name), values[pos:pos + count]))
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
            chains = [cute.arch.fmax(chains[i], chains[i + 1]) if i + 1 < len(chains) else chains[i]
                      for i in range(0, len(chains), 2)]
        return chains[0]

    @cute.jit
    def step(self, acc_S: cute.Tensor, is_first: cutlass.Constexpr[bool], row_scale: cute.Tensor):
        """Turn scores into unnormalised probabilities in place; write each row's O rescale factor
        (1.0 where the max was kept) into row_scale."""
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
                old = self.row_max[r]
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
            self.row_max[r] = row_max
            # A row that has seen only -inf scores subtracts 0 so exp2 gives 0, not NaN.
            max_scaled = (row_max if row_max != -Float32.inf else Float32(0.0)) * self.scale_log2
            # Four partial sums: a single running sum would chain every FADD on the previous one.
            sums = []
            for c in cutlass.range_constexpr(ncols):
                x = row[c] * self.scale_log2 - max_scaled
                if cutlass.const_expr(emulate[c]):
                    p = exp2_emulated(x, self.poly_degree)
                else:
                    p = exp2_mufu(x)
                row[c] = p
                if cutlass.const_expr(c < 4):
                    sums.append(p)
                else:
                    sums[c % 4] = sums[c % 4] + p
            while cutlass.const_expr(len(sums) > 1):
                sums = [sums[i] + sums[i + 1] for i in range(0, len(sums) - 1, 2)] + (
                    [sums[-1]] if len(sums) % 2 else [])
            partial = sums[0]
            if cutlass.const_expr(is_first):
                self.row_sum[r] = partial
            else:
                self.row_sum[r] = self.row_sum[r] * row_scale[r] + partial

    @cute.jit
    def rescale(self, acc_O: cute.Tensor, row_scale: cute.Tensor):
        """O rows *= row_scale; with rescale_branch, skipped when no row of the warp moved its max."""
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
                row_lse = (self.row_max[r] * self.scale_log2 + cute.math.log2(total, fastmath=True)) * LN2
            lse[r] = row_lse
            for c in cutlass.range_constexpr(cute.size(out, mode=[1])):
                out[r, c] = out[r, c] * inv
