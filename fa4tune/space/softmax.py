"""Online-softmax rescaling: skip the O rescale while the running row max rose by at most
`rescale_threshold` (log2 units). Unnormalised probabilities then reach 2**threshold, which the P
operand's dtype must hold with headroom for the row sum. `rescale_branch`: skip the multiplies with
a warp vote and a branch, or always multiply (one straight block for the compiler to schedule).
`lazy_max`: skip the row max of a block unless the row sums show the max rose past the threshold.
The kernel family's rules say which combinations the kernel takes."""

from __future__ import annotations

from .base import SearchSpace


class SoftmaxSpace(SearchSpace):
    name = "softmax"
    knobs = ("rescale_threshold", "rescale_branch", "lazy_max")
    description = (
        "online softmax: threshold below which the O rescale is skipped, how it is skipped, and "
        "whether the row max is taken only when the row sums show a rise"
    )
