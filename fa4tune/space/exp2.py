"""Software exp2: the polynomial degree and the share of exponentials computed on the FMA pipe
instead of MUFU. The kernel family's rules reject a polynomial less accurate than half an ulp of the
output dtype."""

from __future__ import annotations

from .base import SearchSpace


class Exp2Space(SearchSpace):
    name = "exp2"
    knobs = ("poly_degree", "emu_share")
    description = "exp2 emulation: polynomial degree and share of exponentials on the FMA pipe"
