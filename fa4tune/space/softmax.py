"""Online-softmax rescaling: skip the O rescale while the running row max rose by at most
`rescale_threshold` (log2 units). Unnormalised probabilities then reach 2**threshold, which the P
operand's dtype must hold with headroom for the row sum. `rescale_branch`: skip the multiplies with a
warp vote and a branch, or always multiply (one straight block for the compiler to schedule).
`lazy_max`: skip the row max of a block unless the row sums show the max rose past the threshold."""

from __future__ import annotations

import math

from .base import SearchSpace

# Largest finite value of each P operand dtype.
_DTYPE_MAX = {"fp16": 65504.0, "bf16": 3.3895e38}


class SoftmaxSpace(SearchSpace):
    name = "softmax"
    knobs = ("rescale_threshold", "rescale_branch", "lazy_max")
    description = ("online softmax: threshold below which the O rescale is skipped, how it is skipped, and "
                   "whether the row max is taken only when the row sums show a rise")

    def check(self, problem, config, target) -> list[str]:
        from ..kernels.config import lazy_max_reasons

        threshold = config.rescale_threshold
        # P entries reach 2**threshold; a row of tile_n of them is summed in fp32, but each must fit the
        # operand dtype of the P·V GEMM.
        limit = math.log2(_DTYPE_MAX[problem.dtype])
        if threshold >= limit:
            return [
                f"rescale_threshold {threshold:g} lets P reach 2^{threshold:g}, beyond {problem.dtype}'s "
                f"largest value 2^{limit:.1f}"
            ]
        return lazy_max_reasons(config)
