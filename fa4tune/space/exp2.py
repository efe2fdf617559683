"""Software exp2: the polynomial degree and the share of exponentials computed on the FMA pipe
instead of MUFU. A polynomial less accurate than half an ulp of the output dtype is rejected."""

from __future__ import annotations

from .base import SearchSpace


class Exp2Space(SearchSpace):
    name = "exp2"
    knobs = ("poly_degree", "emu_share")
    description = "exp2 emulation: polynomial degree and share of exponentials on the FMA pipe"

    def check(self, problem, config, target) -> list[str]:
        from ..kernels import exp2_poly

        return exp2_poly.accuracy_reasons(config.poly_degree, config.emu_share, problem.dtype)
