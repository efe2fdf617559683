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

from sqlalchemy.engine import make_url

from .. import interrupts
from ..db import ResultsDB, resolve_location, shown_location, sqlite_path
from ..errors import Fa4tuneError, KernelError, StorageError
from ..files import unwritable_ancestor
from ..measure.base import Backend, make_backend, resolve_backend_name
from ..measure.timing import FLUSH_ENV
from ..runtime.tables import TableError, existing_tables, export_table, table_paths
from ..space import ComposedSpace, compose
from ..target import get_target
from . import workers as worker_processes  # a module: benchmarks/simulated_gpus.py patches it
from .job import Job
from .loop import WorkerLoop, problem_sampler
from .provenance import best_provenance, l2_flush, run_gpu_fields, run_l2_flush, versions
from .run import ProblemResult, RunRef
from .studies import (
    check_storage,
    default_storage_location,
    is_server_storage,
    journal_path,
    open_storage,
    quiet_optuna,
    resolved_storage_location,
    try_sampler_options,
    worker_seed,
)


@dataclass
class SearchSummary:
    """What run_search did: the run, where its results and studies are, each problem's result, and
    the tables it exported."""

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


@dataclass
class _Setup:
    """What run_search settles before it checks the job: the composed space, the backend (None
    while there is none in this process: GPU workers, not started yet), the worker processes'
    GPUs (`plan`, None for none), the target, and where the results and the studies go."""

    space: ComposedSpace
    backend: Backend | None
    backend_name: str
    plan: list[str | None] | None
    target: object
    db_location: str
    storage_location: str

    @property
    def is_estimate(self) -> bool:
        # (Not a Backend: the GPU workers; they fill in what the run records of the GPU.)
        return self.backend.is_estimate if self.backend is not None else False


def run_search(
    job: Job,
    *,
    db: str | None = None,
    storage: str | None = None,
    resume: bool = False,
    backend: str | Backend | None = None,
    target=None,
    trials: int | None = None,
    seconds: float | None = None,
    progress: bool = False,
    say=print,
    workers: int | None = None,
    gpus: list[int] | None = None,
) -> SearchSummary:
    """Run (or with `resume`, continue or join) a search job, in this process or, with `workers` or
    `gpus`, in that many worker processes sharing the studies. Everything that can be checked is
    checked before the results DB or the Optuna storage is touched."""
    interrupts.forget()  # a signal that stopped an earlier search in this process is not this one's
    quiet_optuna()
    setup = _set_up(job, backend, target, workers, gpus, db, storage, say)
    # The GPU backend (a worker process) is closed however this ends: before the run is marked
    # finished, after it is marked interrupted or failed.
    try:
        budget_trials, budget_seconds = _preflight(job, setup, trials, seconds)
        if setup.backend is None and (setup.plan is None or setup.backend_name == "model"):
            # With workers, the model's, for the run's record.
            setup.backend = make_backend(setup.backend_name, job.kernel, setup.target)
        if setup.is_estimate and job.export:
            _refuse_estimates_over_measurements(job)  # before the DB or the storage is touched
        flush = l2_flush(setup.is_estimate)  # a bad FA4TUNE_L2_FLUSH, before anything is written

        results_db = ResultsDB.open(setup.db_location, create=True)
        optuna_storage = open_storage(setup.storage_location)
        if setup.backend is not None:
            provenance = {**setup.backend.provenance(), **versions()}
        else:
            provenance = {"gpu_name": None, "sm_count": setup.target.sm_count, **versions()}
        run, summary = _open_run(
            job, setup, results_db, provenance, flush, resume, say, budget_trials, budget_seconds
        )
        _search(
            setup,
            run,
            summary,
            results_db,
            optuna_storage,
            best_provenance(provenance, setup.backend_name, run.run_id, flush),
            progress,
            say,
        )
    finally:
        if setup.backend is not None:
            setup.backend.close()
    results_db.finish_run(run.run_id, "finished")
    if job.export:
        summary.exported = export_table(
            results_db, job.export, kernel=job.kernel, target=setup.target.name
        )
    results_db.close()
    return summary


def _set_up(
    job: Job,
    backend,
    target,
    workers: int | None,
    gpus: list[int] | None,
    db: str | None,
    storage: str | None,
    say,
) -> _Setup:
    """The backend's name (and object, where it runs in this process), the workers' GPUs, the
    target, and the locations of the results DB and the Optuna storage."""
    kernel = job.kernel
    if isinstance(backend, Backend):
        if workers is not None or gpus is not None:
            raise Fa4tuneError(
                "a backend object measures in this process; workers need a backend name"
            )
        backend_name = backend.name
    else:
        backend_name = resolve_backend_name(backend or job.backend, announce=say)
        backend = None
    space = compose(kernel, job.spaces)
    plan = worker_processes.plan_workers(workers, gpus, backend_name)
    wanted = target if target is not None else job.target
    if backend is not None:
        tgt = backend.target
    elif backend_name == "gpu" and plan is not None:  # the workers' GPUs; each checks its own again
        tgt = worker_processes.gpu_target(plan, wanted)
    elif backend_name == "gpu":  # its worker finds the GPU (and refuses a job aimed at another)
        backend = make_backend("gpu", kernel, wanted, announce=say, **job.measure)
        tgt = backend.target
    else:  # the model backend's target
        tgt = get_target(target) if target is not None else job.target or get_target(None)
    db_location = resolve_location(db, job.db)
    storage_location = storage or job.storage or default_storage_location(db_location)
    return _Setup(space, backend, backend_name, plan, tgt, db_location, storage_location)


def _preflight(job: Job, setup: _Setup, trials, seconds) -> tuple[int | None, float | None]:
    """Check what can be checked before anything is written; the trial and time budgets."""
    kernel, space, tgt = job.kernel, setup.space, setup.target
    unsupported = {p.key(): kernel.unsupported_reasons(p, tgt) for p in job.problems}
    unsupported = {k: r for k, r in unsupported.items() if r}
    if unsupported:
        lines = "; ".join(f"{k}: {', '.join(r)}" for k, r in unsupported.items())
        raise KernelError(f"{job.path}: no kernel supports these problems on {tgt.name}: {lines}")
    try_sampler_options(job.sampler, where=f"{job.path}: sampler")
    for problem in job.problems:  # sampler options, grid domains, plugins' defaults and checks,
        problem_sampler(job, space, problem, tgt)  # before anything is written
        space.check(problem, space.default_config(problem, tgt), tgt)
    _check_apart(setup.db_location, setup.storage_location)
    if job.export:  # found out only after the whole search otherwise
        _check_export(job)
    ResultsDB.check(setup.db_location)
    check_storage(setup.storage_location)
    if trials is not None and (
        isinstance(trials, bool) or not isinstance(trials, int) or trials < 1
    ):
        raise Fa4tuneError(
            f"--trials: a positive whole number of measured trials per problem, got {trials!r}"
        )
    if seconds is not None and (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or seconds <= 0
    ):
        raise Fa4tuneError(f"--seconds: a positive number of seconds per problem, got {seconds!r}")
    return (
        trials if trials is not None else job.budget.trials,
        seconds if seconds is not None else job.budget.seconds,
    )


def _open_run(
    job: Job,
    setup: _Setup,
    results_db: ResultsDB,
    provenance: dict,
    flush: str,
    resume: bool,
    say,
    budget_trials: int | None,
    budget_seconds: float | None,
) -> tuple[RunRef, SearchSummary]:
    """Create the run in the results DB, or with `resume` join the job's latest one (of the same
    kernel code, target, and estimates or measurements); say which. The run records its L2 flush
    (`flush`), and one measured under another is not joined: a Fa4tuneError, the DB unchanged."""
    kernel, tgt, is_estimate = job.kernel, setup.target, setup.is_estimate
    kernel_hash = kernel.source_hash()

    def same_flush(previous: dict) -> None:
        measured = run_l2_flush(previous)
        if measured != flush:
            raise Fa4tuneError(
                f"run {previous['id']} of job {job.name!r} in {shown_location(setup.db_location)} "
                f"was timed with the {measured} L2 flush, and this search times with the {flush} "
                f"one ({FLUSH_ENV}={flush}): times of the two do not compare, so it does not "
                f"continue that run. Set {FLUSH_ENV}={measured} to continue it, or leave out "
                "--resume to start a new run; nothing in the results DB was changed"
            )

    run_id, prefix, resumed = results_db.open_run(
        resume=resume,
        study_prefix=lambda rid: f"{job.name}/{kernel.name}-{kernel_hash[:12]}/{tgt.name}/run{rid}",
        check_resume=same_flush,
        details={"l2_flush": flush},
        job_name=job.name,
        job_path=job.path,
        job_text=job.text,
        kernel=kernel.name,
        kernel_hash=kernel_hash,
        target=tgt.name,
        backend=setup.backend_name,
        is_estimate=is_estimate,
        **run_gpu_fields(provenance),
        dsl_version=provenance["dsl_version"],
        torch_version=provenance["torch_version"],
        fa4tune_version=provenance["fa4tune_version"],
        storage_url=shown_location(resolved_storage_location(setup.storage_location)),
    )
    kind = "cost-model" if is_estimate else "measured"
    if resume and not resumed:
        other = results_db.latest_run(
            job.name, kernel.name, kernel_hash, tgt.name, is_estimate=not is_estimate
        )
        if other:
            was = "is a cost-model run" if other["is_estimate"] else "was measured on a GPU"
            why = f" (run {other['id']} {was}; a {kind} search does not continue it)"
        else:
            why = ""
        say(
            f"fa4tune: no earlier {kind} run of job {job.name!r} in "
            f"{shown_location(setup.db_location)}{why}; starting a new one"
        )
    elif resumed:
        say(f"fa4tune: resuming run {run_id} of job {job.name!r}")
    if is_estimate:
        say(
            f"fa4tune: backend {setup.backend_name}: times are ESTIMATES of a cost model for "
            f"{tgt.name}, not measurements"
        )
    summary = SearchSummary(
        run_id=run_id,
        db_location=setup.db_location,
        storage=setup.storage_location,
        backend=setup.backend_name,
        target=tgt.name,
        is_estimate=is_estimate,
        resumed=resumed,
        workers=len(setup.plan) if setup.plan is not None else 1,
    )
    run = RunRef(
        job=job,
        run_id=run_id,
        prefix=prefix,
        kernel_hash=kernel_hash,
        target=tgt,
        budget_trials=budget_trials,
        budget_seconds=budget_seconds,
        shared=setup.plan is not None or is_server_storage(setup.storage_location),
        l2_flush=flush,
    )
    return run, summary


def _search(
    setup: _Setup,
    run: RunRef,
    summary: SearchSummary,
    results_db: ResultsDB,
    optuna_storage,
    provenance: dict,
    progress: bool,
    say,
) -> None:
    """Search the run's problems into summary.results, in this process or in the worker
    processes; the run is marked interrupted or failed when that ends early."""
    try:
        if setup.plan is None:
            # Its own seed where other hosts may share the studies (each with a search like this).
            loop = WorkerLoop(
                run,
                setup.space,
                setup.backend,
                results_db,
                optuna_storage,
                provenance,
                progress,
                say,
                worker_seed=worker_seed(0) if run.shared else 0,
            )
            summary.results = loop.tune_all()
        else:
            summary.results = worker_processes.run_workers(
                run,
                setup.plan,
                setup.backend_name,
                setup.db_location,
                setup.storage_location,
                results_db,
                optuna_storage,
                setup.space,
                summary.is_estimate,
                say,
            )
        interrupts.checkpoint()  # one swallowed during the last confirmation: interrupted
    except KeyboardInterrupt:
        results_db.finish_run(run.run_id, "interrupted")
        raise SearchInterrupted(summary) from None
    except BaseException:
        results_db.finish_run(run.run_id, "failed")
        raise


def _check_export(job: Job) -> None:
    """Every file the job exports to can be written."""
    for target_path in table_paths(job.export):
        blocked = unwritable_ancestor(target_path)
        if blocked is not None:
            raise Fa4tuneError(
                f"{job.path}: export: cannot write {target_path}: {blocked} is not "
                "a writable directory"
            )
        if target_path.is_dir():
            raise Fa4tuneError(f"{job.path}: export: {target_path} is a directory")


def _refuse_estimates_over_measurements(job: Job) -> None:
    """A cost-model search does not export over a table that holds measurements (the shipped table,
    say, when its job is run with --backend model): the measurements would be gone from the file."""
    for path, document in existing_tables(job.export):
        if isinstance(document, TableError):  # not a table we can read: nothing measured to keep
            continue
        measured = sum(not row["is_estimate"] for row in document["entries"])
        if measured:
            raise Fa4tuneError(
                f"cannot export to {path}: it holds {measured} measured "
                f"entr{'y' if measured == 1 else 'ies'}, and this search gives cost-model "
                "estimates, which would replace them in the file. Export somewhere else (fa4tune "
                "search --export PATH, or the job's `export`), or run the search on the GPU"
            )


def _check_apart(db_location: str, storage_location: str) -> None:
    """The results DB and Optuna's storage must be different databases: both have a `trials` table,
    and a SQLite file is locked by one writer at a time."""
    if "://" not in storage_location:  # a journal file: not the results DB's file either
        db_path = sqlite_path(db_location)
        if db_path is not None and db_path.resolve() == journal_path(storage_location).resolve():
            raise StorageError(
                f"the Optuna journal {storage_location!r} is the results DB's file; give the "
                "journal another path with --storage or the job's `storage` (or leave it out: "
                f"{default_storage_location(db_location)})"
            )
        return
    storage_url = make_url(storage_location)
    same = False
    if storage_url.get_backend_name() == "sqlite":  # the same file (an in-memory one is no file)
        db_path, storage_path = sqlite_path(db_location), sqlite_path(storage_location)
        same = (
            db_path is not None
            and storage_path is not None
            and db_path.resolve() == storage_path.resolve()
        )
    elif "://" in db_location:
        db_url = make_url(db_location)

        def where(url):
            return url.get_backend_name(), url.host, url.port, url.database

        same = where(db_url) == where(storage_url)
    if same:
        raise StorageError(
            f"the results DB and the Optuna storage are the same database "
            f"({shown_location(db_location)}); give them two databases (e.g. on one PostgreSQL "
            "server: .../fa4tune and .../optuna)"
        )
