"""Importing the CuTe DSL for a target: it reads its target arch once, when it is first imported, so
a process that compiles sets the arch before that import (a kernel then builds for sm_90a on any
machine, GPU or not)."""

from __future__ import annotations

import os


def import_dsl(target):
    """cutlass.cute, imported for `target`'s arch (unless CUTE_DSL_ARCH already says otherwise)."""
    os.environ.setdefault("CUTE_DSL_ARCH", target.arch)
    import cutlass  # noqa: F401
    import cutlass.cute as cute

    return cute
