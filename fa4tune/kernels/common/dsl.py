"""Importing the CuTe DSL for a target: it reads its target arch once, when it is first imported, so
a process that compiles sets the arch before that import (a kernel then builds for sm_90a on any
machine, GPU or not)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def import_dsl(target):
    """cutlass.cute, imported for `target`'s arch (unless CUTE_DSL_ARCH already says otherwise)."""
    os.environ.setdefault("CUTE_DSL_ARCH", target.arch)
    import cutlass  # noqa: F401
    import cutlass.cute as cute

    return cute


def export_object(function, path, name: str) -> str:
    """Write a compiled host function as an object file (the DSL's AOT export, its symbols prefixed
    with `name`) that `load_object` reads in another process. Written under a temporary name and
    renamed: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".export-") as tmp:
        function.export_to_c(tmp, name, function_prefix=name)
        os.replace(os.path.join(tmp, name + ".o"), path)
    return str(path)


def load_object(path, name: str):
    """The compiled host function `export_object` wrote under `name`."""
    from cutlass.cute.runtime import load_module

    return load_module(str(path))[name]


def dynamic_tensor(dtype, rank: int, align: int):
    """A fake tensor for cute.compile with exactly the run-time types a launch passes
    (from_dlpack(...).mark_layout_dynamic()): every extent a dynamic i32, every stride but the last
    a dynamic i64, the last 1. The compiled function trusts its callers' argument layout, so the
    two must match."""
    import cutlass.cute as cute
    from cutlass.cute import AddressSpace
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(
        dtype,
        tuple(cute.sym_int32() for _ in range(rank)),
        stride=tuple(cute.sym_int64() for _ in range(rank - 1)) + (1,),
        memspace=AddressSpace.generic,
        assumed_align=align,
    )
