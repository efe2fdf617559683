"""The kernel registry: what the search, the DB and the lookup need to know about a kernel, without
importing the CuTe DSL. The kernel modules themselves (and cutlass) are imported only when a kernel
is compiled; the config module is plain Python and is imported lazily on first use."""

from __future__ import annotations

import ast
import hashlib
import importlib
import io
import threading
import tokenize
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from types import ModuleType

from ..errors import KernelError

KERNELS_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class KernelSpec:
    """One tunable kernel: its name, arch, config schema and the spaces a job searches by default."""

    name: str
    arch: str
    family: str
    config_module: str  # module (relative to this package) with FwdConfig-style API
    config_class_name: str
    default_spaces: tuple[str, ...]
    # Files whose code decides the compiled kernel: a change makes tuned tables stale (comments and
    # docstrings do not count: see code_text). Globs relative to this directory; the registry and the
    # fp32 reference do not change what the kernel computes.
    source_globs: tuple[str, ...] = ("*.py",)
    source_excludes: tuple[str, ...] = ("__init__.py", "reference.py")
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    # ---- the config module (lazy) ---------------------------------------------------------------
    @cached_property
    def _module(self) -> ModuleType:
        return importlib.import_module(f"{__name__}.{self.config_module}")

    @property
    def config_class(self) -> type:
        return getattr(self._module, self.config_class_name)

    @property
    def config_error(self) -> type[Exception]:
        return self._module.ConfigError

    @property
    def knobs(self) -> dict[str, tuple]:
        """Every knob of the config and its legal values."""
        return dict(self._module.KNOBS)

    def make_config(self, values: dict):
        """A config object from knob values; raises the kernel's ConfigError on bad ones."""
        return self.config_class.from_dict(dict(values))

    def canonical_values(self, values: dict) -> dict:
        """The knob values with those that have no effect reset (config.canonical()), so that two
        configs compiling to the same code are measured once; values the schema rejects unchanged."""
        try:
            config = self.make_config(values)
        except self.config_error:
            return dict(values)
        canonical = getattr(config, "canonical", None)
        return (canonical() if canonical else config).to_dict()

    def default_config(self, problem, target):
        return self._module.default_config(problem, target)

    def unsupported_reasons(self, problem, target) -> list[str]:
        return list(self._module.unsupported_reasons(problem, target))

    def infeasible_reasons(self, problem, config, target) -> list[str]:
        """All config checks of the kernel; a config dict that the schema rejects is infeasible too."""
        if isinstance(config, dict):
            try:
                config = self.make_config(config)
            except self.config_error as exc:
                return [str(exc)]
        return list(self._module.infeasible_reasons(problem, config, target))

    # ---- identity of the compiled code ------------------------------------------------------------
    def source_files(self) -> list[Path]:
        files: set[Path] = set()
        for pattern in self.source_globs:
            files.update(p for p in KERNELS_DIR.glob(pattern) if p.is_file())
        return sorted(p for p in files if p.name not in self.source_excludes)

    def source_hash(self) -> str:
        """sha256 over the kernel's source files (names and code_text), computed once per process."""
        with self._lock:
            cached = self.__dict__.get("_source_hash")
            if cached is None:
                digest = hashlib.sha256(CODE_HASH_SCHEME + b"\0")
                for path in self.source_files():
                    digest.update(path.name.encode() + b"\0")
                    digest.update(code_text(path.read_text(encoding="utf-8")).encode())
                    digest.update(b"\0")
                cached = digest.hexdigest()
                self.__dict__["_source_hash"] = cached  # frozen dataclass: cache beside the fields
            return cached


# Names what source_hash covers; a new scheme gives every kernel a new hash (and stale tables).
CODE_HASH_SCHEME = b"code-text-1"


def code_text(source: str) -> str:
    """Python source without its comments, docstrings, blank lines and trailing spaces: what is left
    can change the compiled kernel, what is cut cannot, so editing it leaves tuned tables valid.
    Blank lines and trailing spaces inside other string literals are kept (they are data). The cuts
    come from token and node positions, on which Python versions agree (an AST dump does not: 3.12
    added fields). Source that does not parse is taken whole."""
    source = source.replace("\r\n", "\n").replace("\r", "\n")
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        tree = ast.parse(source)
    except (SyntaxError, ValueError, tokenize.TokenError):
        return source
    # Rows as tokenize and ast count them: split on "\n" only (splitlines also splits on \f, \x85, ...).
    lines = source.split("\n")

    def column(row: int, byte: int) -> int:  # the AST counts columns in UTF-8 bytes
        return len(lines[row - 1].encode()[:byte].decode(errors="ignore"))

    docstrings = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings.append(((first.lineno, column(first.lineno, first.col_offset)),
                                   (first.end_lineno, column(first.end_lineno, first.end_col_offset))))
    # Rows that end inside a string literal other than a docstring keep their trailing spaces, and
    # rows wholly inside one are kept even when blank. (3.12 splits f-strings into several tokens.)
    ends_in_string, inside_string, fstring_starts = set(), set(), []
    fstring_start, fstring_end = getattr(tokenize, "FSTRING_START", None), getattr(tokenize, "FSTRING_END", None)
    for tok in tokens:
        if tok.type == fstring_start:
            fstring_starts.append(tok.start)
            continue
        if tok.type == fstring_end:
            start = fstring_starts.pop()
        elif tok.type == tokenize.STRING:
            start = tok.start
        else:
            continue
        if tok.end[0] > start[0] and not any(a <= start < b for a, b in docstrings):
            ends_in_string.update(range(start[0], tok.end[0]))
            inside_string.update(range(start[0] + 1, tok.end[0]))
    spans = docstrings + [(tok.start, tok.end) for tok in tokens if tok.type == tokenize.COMMENT]
    for (row, col), (end_row, end_col) in sorted(spans, reverse=True):  # later cuts first
        if row == end_row:
            lines[row - 1] = lines[row - 1][:col] + lines[row - 1][end_col:]
        else:
            lines[row - 1:end_row] = ([lines[row - 1][:col]] + [""] * (end_row - row - 1)
                                      + [lines[end_row - 1][end_col:]])
    kept = []
    for row, line in enumerate(lines, 1):
        if row in inside_string or row in ends_in_string:
            kept.append(line)
        elif line.strip():
            kept.append(line.rstrip())
    return "\n".join(kept)


KERNELS: dict[str, KernelSpec] = {
    spec.name: spec
    for spec in (
        KernelSpec(
            name="fa4_fwd_sm90",
            arch="sm_90a",
            family="attention_fwd",
            config_module="config",
            config_class_name="FwdConfig",
            default_spaces=("tiles", "pipeline", "exp2", "softmax"),
        ),
    )
}

DEFAULT_KERNEL = "fa4_fwd_sm90"


def get_kernel(name: str | None = None) -> KernelSpec:
    """A kernel by name; an unknown name is an error that lists the known ones."""
    key = DEFAULT_KERNEL if name is None else str(name)
    if key not in KERNELS:
        raise KernelError(f"unknown kernel {name!r}; known kernels: {', '.join(sorted(KERNELS))}")
    return KERNELS[key]


def kernel_for_target(target) -> KernelSpec:
    """The kernel that runs on a target's arch; an error when there is none."""
    for spec in KERNELS.values():
        if spec.arch == target.arch:
            return spec
    raise KernelError(
        f"no fa4tune kernel runs on {target.name} ({target.arch}); kernels: "
        + ", ".join(f"{s.name} ({s.arch})" for s in KERNELS.values())
    )
