"""Optuna's side: where studies live (a journal file beside the results DB by default, any RDB URL
on request), the samplers a job may name, and how studies are named. Optuna's storage is kept apart
from the results DB so that many workers share a study through Optuna, not through our tables."""

from __future__ import annotations

import importlib.util
import logging
import zlib
from pathlib import Path

from .errors import JobError, StorageError

RDB_PREFIXES = ("sqlite:", "postgresql", "mysql", "oracle", "mssql")


def quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(logging.WARNING)


def default_storage_location(db_location: str) -> str:
    """The journal file next to the results DB (or under fa4tune-results/ for a non-file DB)."""
    from .db import sqlite_path

    path = sqlite_path(db_location)
    if path is None:
        return "fa4tune-results/optuna.journal"
    return str(path.with_name(path.stem + ".optuna.journal"))


def open_storage(location: str):
    """An Optuna storage: an RDB URL, or a journal file path (optionally written `journal:PATH`)."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalFileSymlinkLock, JournalStorage

    try:
        if location.startswith(RDB_PREFIXES) and "://" in location:
            return optuna.storages.RDBStorage(location)
        path = Path(location.removeprefix("journal:")).expanduser()
        if path.is_dir():
            raise StorageError(f"Optuna storage {location!r} is a directory; give a journal file path")
        path.parent.mkdir(parents=True, exist_ok=True)
        # An absolute path: Optuna's lock is a symlink to the journal, and a relative target would
        # dangle, so a lock left by a killed search could never be recognised as stale. Writes hold
        # the lock for milliseconds; one held for 5 s belongs to a dead process and is broken.
        journal = str(path.resolve())
        return JournalStorage(JournalFileBackend(journal, lock_obj=JournalFileSymlinkLock(journal, grace_period=5)))
    except StorageError:
        raise
    except Exception as exc:  # Optuna and SQLAlchemy raise many kinds; all mean "cannot use it"
        raise StorageError(f"cannot open Optuna storage {location!r}: {type(exc).__name__}: {exc}") from exc


def check_sampler_available(name: str, where: str) -> None:
    needs = {"cmaes": ["cmaes"], "gp": ["scipy", "torch"]}.get(name, [])
    missing = [m for m in needs if importlib.util.find_spec(m) is None]
    if missing:
        raise JobError(
            f"{where}: the {name} sampler needs {', '.join(missing)}; install it (pip install "
            f"{' '.join(missing)}) or choose tpe, random or grid"
        )


def _grid_sampler_class():
    from optuna.samplers import GridSampler

    class AskTellGridSampler(GridSampler):
        """Optuna's grid sampler stops the study from inside `tell` once the grid is done, which only
        works under study.optimize; the search loop notices an exhausted space itself."""

        def after_trial(self, study, trial, state, values) -> None:
            pass

    return AskTellGridSampler


def make_sampler(spec, seed: int, grid: dict | None = None, where: str = "sampler"):
    """An Optuna sampler from a job's sampler spec; bad options are a JobError naming the field."""
    import optuna.samplers as s

    check_sampler_available(spec.name, where)
    factories = {
        "tpe": lambda **o: s.TPESampler(seed=seed, **o),
        "random": lambda **o: s.RandomSampler(seed=seed, **o),
        "cmaes": lambda **o: s.CmaEsSampler(seed=seed, **o),
        "gp": lambda **o: s.GPSampler(seed=seed, **o),
        "grid": lambda **o: _grid_sampler_class()(grid, seed=seed, **o),
    }
    try:
        return factories[spec.name](**spec.options)
    except (TypeError, ValueError) as exc:
        raise JobError(f"{where}: bad options {spec.options} for the {spec.name} sampler: {exc}") from exc


def problem_seed(seed: int, problem_key: str) -> int:
    """A per-problem seed, stable across runs and processes."""
    return (seed * 1_000_003 + zlib.crc32(problem_key.encode())) % (2**31)


def study_name(prefix: str, space_signature: str, problem_key: str) -> str:
    return f"{prefix}/{space_signature}/{problem_key}"


def make_pruner(margin: float, min_completed: int = 3):
    """An Optuna pruner for cheap first measurements: it stops a candidate whose first (cheap) value
    is more than `margin` above the best completed value so far, once `min_completed` candidates
    have completed. The cheap timing is noisy (few runs), so only a clearly slower one is stopped."""
    from optuna.pruners import BasePruner
    from optuna.trial import TrialState

    class SlowerThanBestPruner(BasePruner):
        def __init__(self) -> None:
            self.margin = margin
            self.min_completed = min_completed

        def best(self, study) -> float | None:
            values = [t.value for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
            return min(values) if len(values) >= self.min_completed else None

        def prune(self, study, trial) -> bool:
            step = trial.last_step
            best = self.best(study)
            if step is None or best is None:
                return False
            return trial.intermediate_values[step] > best * (1.0 + self.margin)

        def explain(self, study, value: float) -> str:
            return (f"stopped after the cheap timing: {value:.4g} ms is more than {self.margin:.0%} above "
                    f"the best so far ({self.best(study):.4g} ms)")

    return SlowerThanBestPruner()
