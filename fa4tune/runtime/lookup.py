"""Runtime lookup: the config to run a problem with, from a results DB or an exported table.

    config, how = fa4tune.lookup(Problem(head_dim=128, seqlen_q=8192, causal=True))

The ladder: the exact problem, else a tuned problem of the same bucket, else the nearest tuned
problem of the same dtype, head dims and causality (distance in log seqlen and log batch·heads),
else one of the sibling dtype (fp16 for bf16 and back: one element width), by the same rules, else
the kernel's default; configs tuned for the installed kernel code come before stale ones whatever
their rung or dtype, and in the problem's bucket measurements before cost-model estimates. A source
is read once and kept in memory; a lookup is a dict access after the first call for a problem. It
never raises for a missing, empty or unreadable source: it returns the default and warns once.
Importing this module imports neither torch nor cutlass."""

from __future__ import annotations

import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from .. import policy
from .. import target as targets
from ..errors import KernelError
from ..kernels import family_for_problem, get_kernel
from ..target import DEFAULT_TARGET, get_target
from .tables import TableError, read_table, table_entries

# The shipped tables: tuning_configs/tables, through the link fa4tune/shipped_tables (a wheel
# carries the files themselves there).
PACKAGE_TABLES = Path(__file__).resolve().parent.parent / "shipped_tables"


@dataclass(frozen=True)
class LookupResult:
    """What `lookup` found: the config, which rung of the ladder it came from ("exact", "bucket",
    "nearest", "other-dtype", "default"), the tuned problem it was borrowed from, whether that
    tuning was done on other kernel code (stale), and whether its time was a cost-model estimate,
    not a measurement."""

    config: object
    source: str
    problem_key: str | None = None
    stale: bool = False
    origin: str | None = None  # the DB or table it came from
    estimate: bool = False

    def __iter__(self):  # `config, how = lookup(p)`
        return iter((self.config, self.source))


MAX_CACHED = 4096  # lookups remembered per source


class _Index:
    """The best configs of one source, grouped for the ladder."""

    def __init__(self, entries, origin: str, warn=None) -> None:
        self.origin = origin
        # (kernel, target) -> [(entry, its problem)]: the problem read once at load (its key and
        # bucket come from it, not from the keys stored beside it, which an older fa4tune may have
        # written).
        self.by_target: dict[tuple[str, str], list] = {}
        skipped = []
        for entry in entries:
            try:
                problem = get_kernel(entry.kernel).problem(entry.problem)
            except (
                KernelError,
                ValueError,
                TypeError,
            ) as exc:  # a problem this fa4tune cannot read
                # (or of a kernel family it lacks): not usable here
                skipped.append(f"{entry.problem_key} ({exc})")
                continue
            self.by_target.setdefault((entry.kernel, entry.target), []).append((entry, problem))
        if skipped and warn is not None:
            warn(
                f"{origin}: {len(skipped)} entries skipped, their problems "
                f"unreadable: {'; '.join(skipped[:3])}"
            )
        self.results: dict = {}  # (kernel, target, problem) -> LookupResult, at most MAX_CACHED


class Lookup:
    """A lookup over one source (a DB location, a table path, or the environment's choice)."""

    def __init__(self, source: str | os.PathLike | None = None) -> None:
        self._source = source
        self._index: _Index | None = None
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    # ---- loading --------------------------------------------------------------------------------
    def _resolve(self) -> str | None:
        if self._source is not None:
            return str(self._source)
        for var in ("FA4TUNE_TABLE", "FA4TUNE_DB"):
            if os.environ.get(var):
                return os.environ[var]
        shipped = sorted(PACKAGE_TABLES.glob("*.yaml")) if PACKAGE_TABLES.is_dir() else []
        return str(PACKAGE_TABLES) if shipped else None

    def _load(self) -> _Index:
        source = self._resolve()
        if source is None:
            self._warn(
                "no tuned table or DB (set FA4TUNE_TABLE or FA4TUNE_DB); using default configs"
            )
            return _Index([], "default")
        try:
            entries = _read_source(source, self._warn)
        except Exception as exc:  # the lookup must never take the caller down
            self._warn(f"cannot read tuned configs from {source} ({exc}); using default configs")
            return _Index([], source)
        if not entries:
            self._warn(f"no tuned configs in {source}; using default configs")
        return _Index(entries, source, self._warn)

    def index(self) -> _Index:
        index = self._index
        if index is None:
            with self._lock:
                if self._index is None:
                    self._index = self._load()
                index = self._index
        return index

    def reload(self) -> None:
        with self._lock:
            self._index = None

    def _warn(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            warnings.warn(f"fa4tune.lookup: {message}", RuntimeWarning, stacklevel=4)

    # ---- the ladder -----------------------------------------------------------------------------
    def __call__(self, problem, target=None, kernel: str | None = None) -> LookupResult:
        index = self.index()
        tgt = _target(target)
        spec = get_kernel(kernel) if kernel is not None else family_for_problem(problem)
        key = (spec.name, tgt.name, problem)
        hit = index.results.get(key)
        if hit is None:
            hit = self._climb(index, spec, tgt, problem)
            if len(index.results) >= MAX_CACHED:  # a server seeing ever new shapes: start over
                index.results.clear()
            index.results[key] = (
                hit  # a dict store is atomic; two threads at worst compute it twice
            )
        return hit

    def _climb(self, index: _Index, spec, target, problem) -> LookupResult:
        installed = spec.source_hash()
        candidates = index.by_target.get((spec.name, target.name), [])
        for lender in policy.for_lookup(policy.lenders(problem, candidates, installed)):
            entry = lender.entry
            try:
                config = spec.config(entry.config)
            except spec.config_error as exc:  # a hand-edited table, or knobs this code lacks
                self._warn(
                    f"{index.origin}: skipped the config of {entry.problem_key}, which "
                    f"{spec.name} cannot take ({exc})"
                )
                continue
            if spec.infeasible_reasons(problem, config, target):
                continue  # a borrowed config must still fit this problem
            if not lender.current:
                self._warn(
                    f"{index.origin} was tuned for other {spec.name} code (hash "
                    f"{entry.kernel_hash[:12]}, installed {installed[:12]}): its configs are stale"
                )
            return LookupResult(
                config,
                lender.source,
                entry.problem_key,
                not lender.current,
                index.origin,
                entry.is_estimate,
            )
        return LookupResult(
            spec.default_config(problem, target), "default", None, False, index.origin
        )


def _read_source(source: str, warn) -> list:

    path = Path(source)
    if path.is_dir():  # one unreadable table of a directory costs its own entries only
        entries = []
        for table in sorted(path.glob("*.yaml")):
            try:
                entries.extend(table_entries(read_table(table)))
            except TableError as exc:
                warn(f"skipped {table}: {exc}")
        return entries
    if path.suffix in (".yaml", ".yml", ".json"):
        return table_entries(read_table(path))
    from ..db import ResultsDB

    with ResultsDB.open(source, create=False) as db:
        return db.best_configs()


_target_cache: dict = {}


def _target(target):
    if target is not None:
        return get_target(target)
    if "default" not in _target_cache:
        # Asking CUDA needs torch; import it only when the caller already has (fa4tune.attention
        # does).
        import sys

        name = os.environ.get("FA4TUNE_TARGET")
        if name:
            _target_cache["default"] = get_target(name)
        elif "torch" in sys.modules:
            _target_cache["default"] = targets.detect_target(undescribed=True) or get_target(
                DEFAULT_TARGET
            )
        else:  # not kept: once torch is imported, the GPU is asked
            if "assumed" not in _target_cache:  # said once: a later call may answer differently
                _target_cache["assumed"] = True
                warnings.warn(
                    f"fa4tune.lookup: no target given and torch not imported, so the GPU was not "
                    f"asked: looking up for {DEFAULT_TARGET} (pass target=, or set FA4TUNE_TARGET)",
                    RuntimeWarning,
                    stacklevel=4,
                )
            return get_target(DEFAULT_TARGET)
    return _target_cache["default"]


_default_lookup = Lookup()
_lookups: dict[str, Lookup] = {}
_lookups_lock = threading.Lock()


def lookup(
    problem, target=None, *, source: str | os.PathLike | None = None, kernel: str | None = None
) -> LookupResult:
    """The config for `problem` on `target` (None: FA4TUNE_TARGET, the local GPU, else H200), from
    `source` (a results DB path/URL or a table file/dir; None: FA4TUNE_TABLE, FA4TUNE_DB, the
    shipped tables), of kernel family `kernel` (None: the family that takes the problem's kind).
    Returns a LookupResult that also unpacks as (config, source)."""
    if source is None:
        return _default_lookup(problem, target, kernel)
    key = str(source)
    found = _lookups.get(key)
    if found is None:
        with _lookups_lock:
            found = _lookups.setdefault(key, Lookup(source))
    return found(problem, target, kernel)


def reset() -> None:
    """Forget every loaded source (after writing a DB or table in the same process)."""
    global _default_lookup
    with _lookups_lock:
        _lookups.clear()
        _default_lookup = Lookup()
    _target_cache.clear()
