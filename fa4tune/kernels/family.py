"""What a kernel family is to the rest of fa4tune.

A family is one folder under fa4tune/kernels/ and one registered instance of a KernelFamily subclass
(fa4tune/kernels/__init__.py). Through it the family gives everything the search, the measurement
workers, the results DB, the tables, the lookup and the dispatcher need, and none of them asks for a
family by name:

- its problem kind (`problem_type`: key, bucket, distance, lending, FLOPs) and its config type
  (`config_type`: an immutable value with `from_dict`, `to_dict`, `canonical` and `short`) with the
  legal values of every knob (`knobs`);
- its feasibility rules (`rules`), the one source that the search spaces and the kernel's
  constructor both call (`infeasible_reasons`, `check`);
- its default config per problem, and the search spaces a job searches when it names none;
- the files whose code decides what it compiles (`source_hash`: a change makes its tables stale);
- compile, export and load of compiled kernels (the gpu backend's compile workers hand object files
  to the measuring worker), and what a launch passes besides the compiled code (`launch_arguments`);
- how the measuring worker runs it on fresh inputs and checks it against its fp32 reference;
- its cost model, for searches without a GPU;
- its torch entry (the prepared launch `fa4tune.attention` keeps per call signature);
- its benchmark peers.

Importing a family imports neither torch nor the CuTe DSL: they are imported by the methods that
compile or run."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..errors import KernelError
from ..problem import Problem
from .source import hash_files

KERNELS_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Rule:
    """One feasibility rule of a family: `check(problem, config, target)` gives the reasons the
    config cannot be built or cannot be right for the problem on the target (none: it passes)."""

    name: str
    check: Callable[[Any, Any, Any], list[str]]

    def __call__(self, problem, config, target) -> list[str]:
        return list(self.check(problem, config, target))


def all_reasons(unsupported, rules, problem, config, target) -> list[str]:
    """A family's reasons against a config: why it takes no such problem (`unsupported(problem,
    target)`), then each rule once, in order."""
    reasons = list(unsupported(problem, target))
    for rule in rules:
        reasons.extend(rule(problem, config, target))
    return reasons


@dataclass(frozen=True)
class Tolerance:
    out: float  # relative Frobenius error of O, in the worst slice
    lse: float  # largest absolute error of the natural-log LSE


@dataclass(frozen=True)
class Check:
    """Errors of one run against the reference: `out_error` (relative Frobenius error of O in the
    slice where it is largest, `worst`: where that is), `lse_error` (max absolute), and `problem`
    when something is wrong beyond any tolerance (NaN left, -inf mismatch)."""

    out_error: float
    lse_error: float
    problem: str | None = None
    worst: tuple | None = None

    def verdict(self, tolerance: Tolerance) -> str | None:
        """Why this run is wrong, or None when it is within tolerance."""
        if self.problem:
            return self.problem
        if not math.isfinite(self.out_error) or self.out_error > tolerance.out:
            where = ""
            if self.worst is not None:
                b, h, start, end = self.worst
                where = f" (batch {b}, head {h}, rows {start}-{end - 1})"
            return f"output error {self.out_error:.3g} above tolerance {tolerance.out:g}{where}"
        if not math.isfinite(self.lse_error) or self.lse_error > tolerance.lse:
            return f"LSE error {self.lse_error:.3g} above tolerance {tolerance.lse:g}"
        return None


@dataclass(frozen=True)
class Peer:
    """Another implementation a family is benchmarked against. `prepare(problem, q, k, v)` gives a
    function of no arguments that runs it once and returns (out, lse or None), or raises
    PeerUnavailable saying why it cannot run here."""

    name: str
    prepare: Callable[..., Callable[[], tuple]]


class PeerUnavailable(Exception):
    """A benchmark peer that is not installed, or cannot take this problem."""


class KernelFamily:
    """The interface every kernel family implements (see the module). Subclasses set the class
    attributes and override what they support; what they do not support raises KernelError naming
    the family and the missing part."""

    name: ClassVar[str] = ""
    arch: ClassVar[str] = ""  # the CuTe DSL / ptxas target, e.g. "sm_90a"
    capability: ClassVar[tuple[int, int]] = (0, 0)  # the CUDA compute capability it runs on
    gpus: ClassVar[str] = ""  # where it runs, in words ("Hopper GPUs (H100, H200: sm_90a)")
    description: ClassVar[str] = ""
    problem_type: ClassVar[type] = Problem
    config_type: ClassVar[type]
    config_error: ClassVar[type[Exception]] = ValueError
    knobs: ClassVar[Mapping[str, tuple]] = {}
    default_spaces: ClassVar[tuple[str, ...]] = ()
    rules: ClassVar[tuple[Rule, ...]] = ()
    # The fa4tune function whose calls this family serves ("attention"), if any.
    entry: ClassVar[str | None] = None
    # Files whose code decides the compiled kernel, relative to `source_root` (None:
    # fa4tune/kernels/, for the built-in families): editing them makes tuned tables stale (comments
    # and docstrings do not count: source.code_text).
    source_root: ClassVar[Path | None] = None
    source_globs: ClassVar[tuple[str, ...]] = ()
    source_excludes: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._hash_lock = threading.Lock()
        self._hash: str | None = None

    def __repr__(self) -> str:
        return f"<kernel family {self.name} ({self.arch})>"

    # ---- configs ------------------------------------------------------------------------------
    def config(self, values):
        """The config of knob values (a mapping; missing knobs take the config type's defaults), or
        a config passed through; raises `config_error` naming the bad knobs."""
        if isinstance(values, self.config_type):
            return values
        return self.config_type.from_dict(dict(values))

    def default_config(self, problem, target):
        """The hand-picked starting point for a problem (the search measures it first)."""
        raise self._missing("a default config")

    def unsupported_reasons(self, problem, target) -> list[str]:
        """Why the family cannot take the problem at all, whatever the config."""
        return []

    def infeasible_reasons(self, problem, config, target) -> list[str]:
        """Every reason the config cannot be built or be right for the problem on the target."""
        return all_reasons(self.unsupported_reasons, self.rules, problem, config, target)

    def avoid_reasons(self, problem, config, target) -> list[str]:
        """Why the search and the default pass over a config the kernel builds and runs right
        (within tolerance) for the problem: a policy, such as an accuracy the family holds a regime
        to. Empty when there is none; the kernel's constructor does not ask."""
        return []

    def check(self, problem, config, target) -> None:
        """Raise `config_error` naming every violated rule (a kernel's constructor calls this)."""
        reasons = self.infeasible_reasons(problem, config, target)
        if reasons:
            raise self.config_error(
                f"config {config.short()} cannot run {problem.key()} on {target.name}: "
                + "; ".join(reasons)
            )

    # ---- problems -----------------------------------------------------------------------------
    def problem(self, values: Mapping):
        """A problem of this family's kind from its stored fields (a DB row, a table entry)."""
        return self.problem_type.from_dict(dict(values))

    def problem_from_job(self, fields: Mapping):
        """A problem from the fields of a job file's problem (shorthands allowed)."""
        return self.problem(fields)

    # ---- the code -----------------------------------------------------------------------------
    def source_files(self) -> list[Path]:
        root = self.source_root or KERNELS_DIR
        files: set[Path] = set()
        for pattern in self.source_globs:
            files.update(p for p in root.glob(pattern) if p.is_file())
        excluded = {root / name for name in self.source_excludes}
        return sorted(p for p in files if p not in excluded)

    def source_hash(self) -> str:
        """The hash of the code that decides the compiled kernel, computed once per process."""
        with self._hash_lock:
            if self._hash is None:
                self._hash = hash_files(self.source_files(), self.source_root or KERNELS_DIR)
            return self._hash

    # ---- compiling and launching (torch and the DSL imported here) -------------------------------
    def compile_key(self, problem, config, target) -> tuple:
        """What a compiled kernel depends on: one compile serves every problem with the same key."""
        raise self._missing("compiling")

    def compile(
        self, problem, config, target, *, options: str | None = None, use_cache: bool = True
    ):
        """The compiled kernel (an object with `.function`, `.key`, `.compile_seconds` and
        `.kernel`, the kernel object or None when loaded), from the compile cache unless `use_cache`
        is False."""
        raise self._missing("compiling")

    def export(self, compiled, path) -> str:
        """Write a compiled kernel as an object file that `load` reads in another process."""
        raise self._missing("exporting compiled kernels")

    def load(self, path, problem, config, target):
        """A compiled kernel from an object file `export` wrote, in this process's compile cache."""
        raise self._missing("loading compiled kernels")

    def artifact_name(self, key: tuple) -> str:
        """A file-name-safe name for a compile key."""
        raise self._missing("compiled-kernel files")

    def launch_arguments(self, problem, config, target) -> dict:
        """The run-time arguments a launch passes that shape the work, beyond the compiled code
        (what `fa4tune carry` compares besides the code)."""
        return {}

    def prepare_launch(self, problem, config, target, *tensors, **options):
        """The torch entry: a callable that launches `config` for calls shaped like `tensors`
        (q, k, v, the softmax scale; with `ragged=` the index tensors of a varlen or paged call,
        common/varlen.Ragged, which the callable then takes after q, k and v)."""
        raise self._missing("a torch entry")

    # ---- measuring on a GPU -------------------------------------------------------------------
    def measurement_case(self, problem, device):
        """Device buffers of the problem's inputs and outputs, reused for every candidate."""
        raise self._missing("GPU measurement")

    def randomize(self, case, seed: int) -> None:
        """Fresh random inputs in the case's buffers, the same for the same seed."""
        raise self._missing("GPU measurement")

    def poison(self, case) -> None:
        """Fill the outputs with NaN, so that an element a run does not write shows."""
        raise self._missing("GPU measurement")

    def reference(self, case):
        """What `compare` compares a run's outputs with (fp32, from the case's inputs)."""
        raise self._missing("GPU measurement")

    def compare(self, case, reference) -> Check:
        raise self._missing("GPU measurement")

    def launcher(self, case, config, target) -> Callable[[], None]:
        """A function that runs the config once on the case (on the current stream)."""
        raise self._missing("GPU measurement")

    def tolerance(self, problem) -> Tolerance:
        raise self._missing("GPU measurement")

    # ---- estimates and peers ------------------------------------------------------------------
    def work_flops(self, problem) -> float:
        """The FLOPs one call does, by the usual convention (what TFLOP/s count): the forward's."""
        return problem.flops

    def cost_model(self, target, assumptions=None):
        """An object with `time_s(config, problem) -> (seconds, details)` and
        `provenance() -> dict`: what the `model` backend times candidates with."""
        raise self._missing("a cost model (search it with the gpu backend)")

    def peers(self) -> list[Peer]:
        """Other implementations to benchmark against."""
        return []

    def ragged_peers(self) -> list[Peer]:
        """Other implementations to benchmark ragged problems (varlen, paged) against: their
        `prepare(problem, case)` takes the family's measurement case."""
        return []

    def _missing(self, what: str) -> KernelError:
        return KernelError(f"kernel family {self.name} has no {what}")
