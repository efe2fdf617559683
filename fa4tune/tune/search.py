"""The search job: one Optuna study per problem. The kernel's default config is measured first, the
best configs of tuned neighbours next (warm start), then the sampler's suggestions (starts.py).
Every suggestion passes the union of the spaces' and the kernel's checks before the backend sees
it; infeasible ones are stored with their reasons and told to Optuna as pruned. Every finished
trial is in the results DB before Optuna hears of it, so a kill loses nothing that finished and
`resume` picks up the studies (problem_search.py).

One worker or many (`workers.py`: one process per GPU, on one host or several) run the same loop
(loop.py), sharing each problem's study through Optuna's storage; what must happen once happens
under the study's lock in the results DB (sharing.py).

Here: `run_search`, which checks everything it can before the results DB or the Optuna storage is
touched, opens (or joins) the run, searches it, and exports its table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import __version__, interrupts
from ..db import ResultsDB, resolve_location, shown_location, sqlite_path
from ..errors import Fa4tuneError, KernelError, StorageError
from .job import Job
from .loop import WorkerLoop, problem_sampler
from .provenance import best_provenance, run_gpu_fields, versions
from .run import ProblemResult, RunRef
from ..measure.base import Backend, make_backend, resolve_backend_name
from ..space import compose
from .studies import (check_storage, default_storage_location, is_server_storage, open_storage,
                      quiet_optuna, try_sampler_options, worker_seed)
from ..target import get_target


@dataclass
class SearchSummary:
    run_id: int
    db_location: str
    storage: str
    backend: str
    target: str
    is_estimate: bool
    results: list[ProblemResult] = field(default_factory=list)
    exported: list[str] = field(default_factory=list)
    resumed: bool = False
    workers: int = 1


class SearchInterrupted(Exception):
    """Ctrl-C or SIGTERM during a search; every finished trial is stored."""

    def __init__(self, summary: SearchSummary) -> None:
        super().__init__("search interrupted")
        self.summary = summary


def _choose_target(job: Job, override):
    """The model backend's target (the gpu backend's is the GPU its worker sees)."""
    if override is not None:
        return get_target(override)
    return job.target or get_target(None)


def run_search(job: Job, *, db: str | None = None, storage: str | None = None, resume: bool = False,
               backend: str | Backend | None = None, target=None, trials: int | None = None,
               seconds: float | None = None, progress: bool = False, say=print, workers: int | None = None,
               gpus: list[int] | None = None) -> SearchSummary:
    """Run (or with `resume`, continue or join) a search job, in this process or, with `workers` or
    `gpus`, in that many worker processes sharing the studies. Everything that can be checked is
    checked before the results DB or the Optuna storage is touched."""
    interrupts.forget()  # a signal that stopped an earlier search in this process is not this one's
    quiet_optuna()
    kernel = job.kernel
    if isinstance(backend, Backend):
        if workers is not None or gpus is not None:
            raise Fa4tuneError("a backend object measures in this process; workers need a backend name")
        backend_name = backend.name
    else:
        backend_name = resolve_backend_name(backend or job.backend, announce=say)
    space = compose(kernel, job.spaces)
    from .workers import plan_workers

    plan = plan_workers(workers, gpus, backend_name)
    if isinstance(backend, Backend):
        tgt = backend.target
    elif backend_name == "gpu" and plan is not None:  # the workers' GPUs; each worker checks its own again
        from .workers import gpu_target

        tgt = gpu_target(plan, target if target is not None else job.target)
    elif backend_name == "gpu":  # its worker finds the GPU (and refuses a job aimed at another)
        backend = make_backend("gpu", kernel, target if target is not None else job.target, announce=say,
                               **job.measure)
        tgt = backend.target
    else:
        tgt = _choose_target(job, target)
    db_location = resolve_location(db, job.db)
    storage_location = storage or job.storage or default_storage_location(db_location)
    # The GPU backend (a worker process) is closed however this ends: before the run is marked
    # finished, after it is marked interrupted or failed.
    try:
        unsupported = {p.key(): kernel.unsupported_reasons(p, tgt) for p in job.problems}
        unsupported = {k: r for k, r in unsupported.items() if r}
        if unsupported:
            lines = "; ".join(f"{k}: {', '.join(r)}" for k, r in unsupported.items())
            raise KernelError(f"{job.path}: no kernel supports these problems on {tgt.name}: {lines}")
        try_sampler_options(job.sampler, where=f"{job.path}: sampler")
        for problem in job.problems:  # sampler options, grid domains, plugins' defaults and checks,
            problem_sampler(job, space, problem, tgt)  # before anything is written
            space.check(problem, space.default_config(problem, tgt), tgt)
        _check_apart(db_location, storage_location)
        if job.export:  # found out only after the whole search otherwise
            from ..files import unwritable_ancestor
            from ..runtime.tables import table_paths

            for target_path in table_paths(job.export):
                blocked = unwritable_ancestor(target_path)
                if blocked is not None:
                    raise Fa4tuneError(f"{job.path}: export: cannot write {target_path}: {blocked} is not a "
                                       "writable directory")
                if target_path.is_dir():
                    raise Fa4tuneError(f"{job.path}: export: {target_path} is a directory")
        ResultsDB.check(db_location)
        check_storage(storage_location)
        if trials is not None and (isinstance(trials, bool) or not isinstance(trials, int) or trials < 1):
            raise Fa4tuneError(f"--trials: a positive whole number of measured trials per problem, got {trials!r}")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not math.isfinite(seconds) or seconds <= 0):
            raise Fa4tuneError(f"--seconds: a positive number of seconds per problem, got {seconds!r}")
        budget_trials = trials if trials is not None else job.budget.trials
        budget_seconds = seconds if seconds is not None else job.budget.seconds
        if not isinstance(backend, Backend) and (plan is None or backend_name == "model"):
            backend = make_backend(backend_name, kernel, tgt)  # with workers, the model's for the run's record
        # (Not a Backend: the GPU workers, not started yet; they fill in what the run records of the GPU.)
        is_estimate = backend.is_estimate if isinstance(backend, Backend) else False
        if is_estimate and job.export:
            _refuse_estimates_over_measurements(job)  # before the DB or the storage is touched

        results_db = ResultsDB.open(db_location, create=True)
        optuna_storage = open_storage(storage_location)
        kernel_hash = kernel.source_hash()
        if isinstance(backend, Backend):
            provenance = {**backend.provenance(), **versions()}
        else:
            provenance = {"gpu_name": None, "sm_count": tgt.sm_count, **versions()}
        run_id, prefix, resumed = results_db.open_run(
            resume=resume, study_prefix=lambda rid: f"{job.name}/{kernel.name}-{kernel_hash[:12]}/{tgt.name}/run{rid}",
            job_name=job.name, job_path=job.path, job_text=job.text, kernel=kernel.name,
            kernel_hash=kernel_hash, target=tgt.name, backend=backend_name, is_estimate=is_estimate,
            **run_gpu_fields(provenance),
            dsl_version=provenance["dsl_version"], torch_version=provenance["torch_version"],
            fa4tune_version=__version__, storage_url=shown_location(storage_location),
        )
        if resume and not resumed:
            other = results_db.latest_run(job.name, kernel.name, kernel_hash, tgt.name, is_estimate=not is_estimate)
            say(f"fa4tune: no earlier {'cost-model' if is_estimate else 'measured'} run of job {job.name!r} in "
                f"{shown_location(db_location)}"
                + (f" (run {other['id']} {'is a cost-model run' if other['is_estimate'] else 'was measured on a GPU'}; "
                   f"a {'cost-model' if is_estimate else 'measured'} search does not continue it)" if other else "")
                + "; starting a new one")
        elif resumed:
            say(f"fa4tune: resuming run {run_id} of job {job.name!r}")
        if is_estimate:
            say(f"fa4tune: backend {backend_name}: times are ESTIMATES of a cost model for {tgt.name}, "
                "not measurements")
        summary = SearchSummary(run_id=run_id, db_location=db_location, storage=storage_location,
                                backend=backend_name, target=tgt.name, is_estimate=is_estimate, resumed=resumed,
                                workers=len(plan) if plan is not None else 1)
        run = RunRef(job=job, run_id=run_id, prefix=prefix, kernel_hash=kernel_hash, target=tgt,
                     budget_trials=budget_trials, budget_seconds=budget_seconds,
                     shared=plan is not None or is_server_storage(storage_location))
        try:
            if plan is None:
                # Its own seed where other hosts may share the studies (each with a search like this one).
                loop = WorkerLoop(run, space, backend, results_db, optuna_storage,
                                  best_provenance(provenance, backend_name, run_id), progress, say,
                                  worker_seed=worker_seed(0) if run.shared else 0)
                summary.results = loop.tune_all()
            else:
                from .workers import run_workers

                summary.results = run_workers(run, plan, backend_name, db_location, storage_location, results_db,
                                              optuna_storage, space, is_estimate, say)
            interrupts.checkpoint()  # one swallowed during the last confirmation: interrupted, not finished
        except KeyboardInterrupt:
            results_db.finish_run(run_id, "interrupted")
            raise SearchInterrupted(summary) from None
        except BaseException:
            results_db.finish_run(run_id, "failed")
            raise
    finally:
        if isinstance(backend, Backend):
            backend.close()
    results_db.finish_run(run_id, "finished")
    if job.export:
        from ..runtime.tables import export_table

        summary.exported = export_table(results_db, job.export, kernel=kernel, target=tgt.name)
    results_db.close()
    return summary


def _refuse_estimates_over_measurements(job: Job) -> None:
    """A cost-model search does not export over a table that holds measurements (the shipped table,
    say, when its job is run with --backend model): the measurements would be gone from the file."""
    from ..runtime.tables import TableError, existing_tables

    for path, document in existing_tables(job.export):
        if isinstance(document, TableError):  # not a table we can read: nothing measured to keep
            continue
        measured = sum(not row["is_estimate"] for row in document["entries"])
        if measured:
            raise Fa4tuneError(
                f"cannot export to {path}: it holds {measured} measured entr{'y' if measured == 1 else 'ies'}, and "
                "this search gives cost-model estimates, which would replace them in the file. Export somewhere "
                "else (fa4tune search --export PATH, or the job's `export`), or run the search on the GPU")


def _check_apart(db_location: str, storage_location: str) -> None:
    """The results DB and Optuna's storage must be different databases: both have a `trials` table,
    and a SQLite file is locked by one writer at a time."""
    from sqlalchemy.engine import make_url

    if "://" not in storage_location:
        return
    storage_url = make_url(storage_location)
    same = False
    if storage_url.get_backend_name() == "sqlite":  # the same file (an in-memory storage is no file)
        db_path, storage_path = sqlite_path(db_location), sqlite_path(storage_location)
        same = db_path is not None and storage_path is not None and db_path.resolve() == storage_path.resolve()
    elif "://" in db_location:
        db_url = make_url(db_location)
        same = (db_url.get_backend_name(), db_url.host, db_url.port, db_url.database) == \
            (storage_url.get_backend_name(), storage_url.host, storage_url.port, storage_url.database)
    if same:
        raise StorageError(
            f"the results DB and the Optuna storage are the same database ({shown_location(db_location)}); "
            "give them two databases (e.g. on one PostgreSQL server: .../fa4tune and .../optuna)"
        )
