"""The search job: one Optuna study per problem. The kernel's default config is measured first, the
best configs of tuned neighbours next (warm start), then the sampler's suggestions. Every suggestion
passes the union of the spaces' and the kernel's checks before the backend sees it; infeasible ones
are stored with their reasons and told to Optuna as pruned. Every finished trial is in the results DB
before Optuna hears of it, so a kill loses nothing that finished and `resume` picks up the studies.

One worker or many (`workers.py`: one process per GPU, on one host or several) run the same loop,
sharing each problem's study through Optuna's storage. What must happen once happens under the
study's lock in the results DB (`ResultsDB.locked`), where each worker:
  - queues the default, warm-start and probe configs unless they are stored, queued or running already;
  - claims a candidate before measuring it: a config stored already is a repeat (Optuna hears the
    stored outcome), one another worker is measuring is a repeat too, and a budget slot is taken only
    while stored measurements plus claims in flight stay below the budget. The claim is the trial's
    CLAIM_ATTR in Optuna: it holds its slot while the trial is RUNNING, and a dead worker's claim
    passes to the trial's queued copy when it is handed back (studies.py), which keeps the slot for
    whoever measures it;
  - hands back the trials of dead workers (their stored outcome told to Optuna, or failed and queued
    again by Optuna's retry callback).
The results DB also refuses a second search trial of one config in a study (DuplicateTrial)."""

from __future__ import annotations

import math
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

from .. import __version__, interrupts, policy
from ..db import DuplicateTrial, ResultsDB, config_key, resolve_location, shown_location, sqlite_path
from ..errors import BackendUnavailable, Fa4tuneError, KernelError, StorageError
from .grid import Grid, GridState
from .job import Job
from .provenance import best_provenance, run_gpu_fields, versions
from .run import ProblemResult, ResultsReport, RunRef
from ..measure.base import Backend, Measurement, make_backend, resolve_backend_name
from ..problem import Problem
from ..space import ComposedSpace, compose
from .studies import (CLAIM_ATTR, WORKER_ATTR, check_storage, default_storage_location, fail_stale, give_back,
                      hand_back, is_server_storage, make_sampler, open_storage, problem_seed,
                      queued_params, quiet_optuna, Heartbeat, study_name, trial_orphaned,
                      worker_gone,
                      try_sampler_options, worker_name, worker_seed)
from ..target import get_target

SOURCE_ATTR = "fa4tune_source"
# A sampler that keeps proposing configs it has already seen has converged on this problem (not the
# grid sampler: it asks for each point once, and its repeats are points that are one config).
MAX_CONSECUTIVE_REPEATS = 25
# How often a worker that waits for other workers' last trials of a problem looks again.
POLL_S = 0.2


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
            _sampler_for(job, space, problem, tgt)  # before anything is written
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


def _sampler_for(job: Job, space: ComposedSpace, problem: Problem, target, worker_seed: int = 0,
                 shared: bool = False, earlier_trials: int = 0):
    """The problem's sampler. A study that already has trials (a resume, a restarted worker) gets a
    seed of its own: with the first session's, a random sampler replays the configs measured then, and
    a run of repeats reads as convergence."""
    grid = space.grid(problem, target) if job.sampler.name == "grid" else None
    return make_sampler(job.sampler, problem_seed(job.seed, problem.key(), worker_seed, earlier_trials), grid=grid,
                        where=f"{job.path}: sampler", shared=shared, grid_seed=problem_seed(job.seed, problem.key()))


class WorkerLoop:
    """One worker's search over the job's problems (the only worker, or one of many)."""

    def __init__(self, run: RunRef, space: ComposedSpace, backend: Backend | None, db: ResultsDB, storage,
                 provenance: dict, progress: bool, say, worker_seed: int = 0, summarise: bool = True) -> None:
        self.run, self.job, self.kernel, self.target = run, run.job, run.job.kernel, run.target
        self.space, self.backend, self.db, self.storage = space, backend, db, storage
        self.provenance, self.progress, self.say = provenance, progress, say
        self.worker = worker_name()
        self.worker_seed = worker_seed
        self.summarise = summarise
        self.budget_trials, self.budget_seconds = run.budget_trials, run.budget_seconds
        self.report = ResultsReport(run, space, db)
        self._state: dict[str, dict] = {}  # per study: this worker's clock and counters over passes
        self._study_ids: dict[str, int] = {}  # per study: its id in the Optuna storage
        self._grids: dict[str, Grid] = {}  # per study of a grid search: its points

    # ---- the problems -------------------------------------------------------------------------
    def tune_all(self) -> list[ProblemResult]:
        """Every problem: a first pass that leaves a problem whose last trials other workers are
        measuring, then a pass that waits for those (and measures what dead workers hand back)."""
        done: dict[Problem, ProblemResult] = {}
        for wait in (False, True):
            for problem in self.job.problems:
                if problem not in done:
                    result = self.tune(problem, wait=wait)
                    if result is not None:
                        done[problem] = result
        return [done[p] for p in self.job.problems]

    def study(self, problem: Problem):
        import optuna

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study = optuna.create_study(
                study_name=self.run.study_name(self.space, problem), storage=self.storage, direction="minimize",
                sampler=optuna.samplers.RandomSampler(),  # replaced below, once its trials are counted
                pruner=(self.backend.make_pruner() if self.backend else None) or optuna.pruners.NopPruner(),
                load_if_exists=True)
            earlier = len(study.get_trials(deepcopy=False))
            study.sampler = _sampler_for(self.job, self.space, problem, self.target, self.worker_seed,
                                         self.run.shared, earlier)
        name = study.study_name
        self._study_ids[name] = self.storage.get_study_id_from_name(name)
        if self.job.sampler.name == "grid":
            self._grids[name] = Grid(study, self.storage, self._study_ids[name],
                                     self.space.grid(problem, self.target))
        return study

    def tune(self, problem: Problem, wait: bool = True) -> ProblemResult | None:
        """Search one problem until a stop reason, then confirm and summarise it; None when other
        workers still measure its last trials and `wait` is False (come back later)."""
        study = self.study(problem)
        name = study.study_name
        if name not in self._state:
            # The time budget counts the seconds spent inside tune() on this problem, a resumed run's
            # earlier sessions included: a problem that spent it before the search stopped stays done.
            # (Not the time on other problems between tune_all's two passes.)
            self._state[name] = {"spent": self.db.study_seconds(self.run.run_id, name), "repeats": 0,
                                 "consecutive": 0, "first": True}
        state = self._state[name]
        if state["first"]:
            self.recover(study, name)
            self._enqueue_starts(study, problem, name)
            # A resume whose first candidates kill the GPU worker checks the GPU with an earlier session's config.
            good = self.db.known_good_config(kernel=self.kernel.name, kernel_hash=self.run.kernel_hash,
                                             target=self.target.name, problem_key=problem.key())
            if good is not None:
                self.backend.note_stored_good(problem, good)
            state["first"] = False
        state["entered"] = time.monotonic()
        result = self.report.counts(problem, name)
        result.repeats = state["repeats"]
        size = self.space.size(problem, self.target)
        bar = _progress_bar(problem, self.budget_trials, result.measured, self.progress)
        # Candidates asked of Optuna ahead of their measurement, so that the backend can compile them
        # while it measures the current one (lookahead 0: one at a time).
        queue: deque[_Candidate] = deque()
        try:
            while True:
                interrupts.checkpoint()  # a Ctrl-C that the garbage collector swallowed stops it here
                result = self.report.counts(problem, name, result)  # other workers' trials count too
                stop = self._stop_reason(result, size, state, name)
                grid = GridState.OPEN if stop or queue else self._grid_left(name)
                # Checked again where a failed point and its queued copy are written.
                if grid is GridState.DONE:
                    with self.db.locked(name):
                        grid = self._grid_left(name)
                if grid is GridState.DONE:
                    stop = f"grid exhausted (all {self._grids[name].size} points tried)"
                if stop:
                    result.stopped = stop
                    break
                if not queue and (grid is GridState.BUSY or
                                  not self._slot_free(study, name, result)):
                    if not wait:
                        return None  # the budget or the grid's last points: other workers measure them
                    time.sleep(POLL_S)
                    self.recover(study, name)
                    continue
                while len(queue) < 1 + self.backend.lookahead and \
                        (not queue or self._grid_left(name) is GridState.OPEN):
                    queue.append(self._ask(study, problem, name))
                outcome = self._run(study, problem, name, queue.popleft())
                if outcome in ("full", "lost"):
                    continue
                if outcome == "repeat":
                    result.repeats += 1
                    state["repeats"] += 1
                    state["consecutive"] += 1
                    continue
                state["consecutive"] = 0
                if outcome != "pruned" and bar is not None:
                    bar.update(1)
                if bar is not None:
                    top = self.db.top_trials(name, 1)
                    shown = f"best {top[0]['tflops']:.0f} TFLOP/s" if top else "no feasible config yet"
                    bar.set_postfix_str(f"{shown}, pruned {result.pruned}")
        finally:
            try:
                for candidate in queue:  # asked but never measured: nothing to learn from them
                    self._fail_unmeasured(study, name, candidate.trial.number)
                    candidate.heartbeat.join()
                    if not candidate.reasons and self.backend.lookahead:
                        self.backend.discard(problem, candidate.config)
                if bar is not None:
                    bar.close()
            finally:
                state["spent"] = self._elapsed(state)
                self._record_seconds(name, state["spent"])
        # Others' trials still in flight: the best few are confirmed once all are in. A trial another
        # worker has asked for but not claimed holds no budget slot, yet is waited for too (a live
        # worker settles it at once, a dead one's goes stale and recover() fails it): a finished
        # problem leaves no trial RUNNING.
        while self._still_running(study, name):
            interrupts.checkpoint()
            if not wait:
                return None
            time.sleep(POLL_S)
            self.recover(study, name)
        if self.backend.confirms_best and not self.db.confirmed(name) and self._claim_confirmation(name):
            try:
                self._confirm(problem, name)
            finally:  # done (or failed): trials measured later, by a resume or another host, need one too
                self._release_confirmation(name)
        result = self.report.counts(problem, name, result)
        if self.summarise:
            self.say(self.report.summary_line(problem, result, self.backend.is_estimate))
        return result

    @staticmethod
    def _elapsed(state: dict) -> float:
        """Seconds spent on the problem: earlier calls and sessions, and this call so far."""
        return state["spent"] + time.monotonic() - state["entered"]

    def _record_seconds(self, name: str, seconds: float) -> None:
        """Store how long this worker has searched the study (for a resume's time budget). On the way
        out of an interrupted search a failure here is reported, not raised over the interrupt."""
        try:
            self.db.record_study_seconds(self.run.run_id, name, seconds)
        except Exception as exc:  # noqa: BLE001 - the search's own exception, if any, matters more
            self.say(f"fa4tune: could not record the search time of {name}: {exc}")

    def _stop_reason(self, result: ProblemResult, size, state: dict, name: str) -> str:
        if self.budget_trials is not None and result.measured >= self.budget_trials:
            return f"trial budget ({self.budget_trials}) reached"
        if self.budget_seconds is not None and self._elapsed(state) >= self.budget_seconds:
            return f"time budget ({self.budget_seconds:g} s) reached"
        if size is not None and result.measured + result.pruned >= size:
            return f"space exhausted (all {size} configs tried)"
        if result.pruned >= self.job.budget.pruned_cap:
            return f"{result.pruned} infeasible suggestions; the space is mostly infeasible for this problem"
        if state["consecutive"] >= MAX_CONSECUTIVE_REPEATS and self.job.sampler.name != "grid":
            return "converged (the sampler only proposes configs already tried)"
        return ""

    def _grid_left(self, name: str) -> GridState:
        """What is left of a grid search's points (OPEN for a search of another sampler)."""
        grid = self._grids.get(name)
        return grid.state() if grid is not None else GridState.OPEN

    # ---- sharing the study --------------------------------------------------------------------
    def _in_flight(self, study, stored_among, trials=None, exclude: int | None = None,
                   reserved: bool = True) -> list:
        """The claims that hold budget slots: trials being measured (RUNNING, claimed, not stored
        yet) and, with `reserved`, the trials of dead workers queued again with their claim (WAITING),
        which keep their slot for whoever measures them. `stored_among(numbers)`: which of these
        trial numbers the results DB has."""
        import optuna

        states = (optuna.trial.TrialState.RUNNING,) + ((optuna.trial.TrialState.WAITING,) if reserved else ())
        if trials is None:
            trials = study.get_trials(deepcopy=False, states=states)
        claimed = [t for t in trials if t.state in states and CLAIM_ATTR in t.user_attrs and t.number != exclude]
        stored = stored_among([t.number for t in claimed if t.state == optuna.trial.TrialState.RUNNING])
        return [t for t in claimed if t.number not in stored]

    def _measuring(self, study, name: str, trials=None) -> list:
        """Claimed trials being measured now (by any worker); `trials`: the study's, if already read."""
        return self._in_flight(study, lambda numbers: self.db.stored_among(name, numbers), trials=trials,
                               reserved=False)

    def _still_running(self, study, name: str) -> bool:
        """Whether a claimed trial is being measured (by any worker), or another worker (or an unnamed
        search) holds a RUNNING trial of the study: one read of the study's running trials for both."""
        import optuna

        running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        if self._measuring(study, name, trials=running):
            return True
        return any(t.user_attrs.get(WORKER_ATTR) != self.worker for t in running)

    def _slot_free(self, study, name: str, result: ProblemResult) -> bool:
        """Whether a budget slot is free now, or kept for a handed-back trial that this worker may
        pick up (a hint; the claim decides under the lock)."""
        if self.budget_trials is None:
            return True
        return result.measured + len(self._measuring(study, name)) < self.budget_trials

    def _claim(self, study, name: str, problem: Problem, candidate: "_Candidate") -> str:
        """Under the study's lock: "repeat" (stored already, or being measured by another worker;
        Optuna has heard), "pruned" (infeasible; stored and told), "full" (no budget slot left; the
        trial went back to the queue or failed), "lost" (another worker handed this trial back), or
        "claimed" (measure it)."""
        import optuna

        trial, config = candidate.trial, candidate.config
        with self.db.locked(name) as lock:
            active = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,
                                                              optuna.trial.TrialState.WAITING))
            mine = next((t for t in active if t.number == trial.number), None)
            if mine is None or mine.state != optuna.trial.TrialState.RUNNING or \
                    mine.user_attrs.get(WORKER_ATTR) != self.worker:
                return "lost"
            earlier = lock.stored(config)
            if earlier is not None:  # never measure a config twice: tell Optuna what it gave before
                _tell_stored(study, trial.number, earlier)
                return "repeat"
            if candidate.reasons:
                measurement = Measurement.pruned(candidate.reasons, is_estimate=self.backend.is_estimate)
                lock.add_trial(run_id=self.run.run_id, optuna_number=trial.number, kernel=self.kernel.name,
                               kernel_hash=self.run.kernel_hash, target=self.target.name, problem=problem,
                               config=config, measurement=measurement, source=candidate.source,
                               provenance=self.provenance)
                _tell(study, trial.number, "pruned", None)
                return "pruned"
            key = config_key(config)
            in_flight = self._in_flight(study, lock.stored_among, active, exclude=trial.number)
            if any(t.user_attrs[CLAIM_ATTR] == key for t in in_flight):
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
                return "repeat"
            if self.budget_trials is not None and lock.measured() + len(in_flight) >= self.budget_trials:
                if "fixed_params" in mine.system_attrs or "failed_trial" in mine.system_attrs:
                    give_back(study, mine)  # a queued config: another worker (or pass) takes it
                else:
                    self._fail_and_requeue(study, trial.number)
                return "full"
            trial.set_user_attr(CLAIM_ATTR, key)
            return "claimed"

    def recover(self, study, name: str, dead: frozenset = frozenset()) -> None:
        """Hand back what dead workers left RUNNING (`dead`: worker names known dead): its stored
        outcome told to Optuna, else the trial failed and queued again. Trials of another host
        are judged by Optuna's heartbeat (server storages)."""
        import optuna

        with self.db.locked(name) as lock:
            fail_stale(study)
            for frozen in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
                if frozen.user_attrs.get(WORKER_ATTR) == self.worker or \
                        not trial_orphaned(frozen, self.run.shared, dead):
                    continue
                stored = lock.stored_number(frozen.number)
                if stored is not None:
                    _tell_stored(study, frozen.number, stored)
                else:
                    hand_back(study, frozen)

    def _claim_confirmation(self, name: str) -> bool:
        """Whether this worker re-times the study's best few (one worker does, unless it died)."""
        with self.db.locked(name) as lock:
            holder = lock.confirming()
            if self.db.confirmed(name) or (holder not in (None, self.worker) and not worker_gone(holder)):
                return False
            lock.set_confirming(self.worker)
            return True

    def _release_confirmation(self, name: str) -> None:
        with self.db.locked(name) as lock:
            if lock.confirming() == self.worker:
                lock.set_confirming(None)

    # ---- one candidate ------------------------------------------------------------------------
    def _ask(self, study, problem: Problem, name: str) -> "_Candidate":
        """Ask Optuna for the next config, marked as this worker's, and check it; a feasible new one
        is handed to the backend to prepare (compile) while earlier candidates are measured."""
        import optuna

        while True:
            heartbeat = trial = None
            try:
                # Ctrl-C waits until the trial has its heartbeat and its worker's name: from there on
                # the except below settles it; before, nothing could (it would stay RUNNING).
                with interrupts.critical():
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # "heartbeat is supposed to be used with optimize"
                        trial = study.ask()
                    # The heartbeat first: a trial with a worker's name always has one, so that if the
                    # worker dies now, the trial either goes stale or, unnamed, is handed back at once.
                    heartbeat = Heartbeat(self.storage, self._study_ids[name], trial.number).start()
                    trial.set_user_attr(WORKER_ATTR, self.worker)
                params = self.space.suggest(trial, problem, self.target)
            except optuna.exceptions.UpdateFinishedTrialError:
                # Unnamed, it was taken for a dead search's and handed back (studies.trial_orphaned):
                # ask again.
                if heartbeat is not None:
                    heartbeat.join()
                continue
            except BaseException:
                if heartbeat is not None:
                    heartbeat.join()
                if trial is not None:
                    self._settle(study, name, trial.number)
                raise
            break
        try:
            config = self.space.full_config(problem, self.target, params)
            reasons = self.space.check(problem, config, self.target)
        except BaseException:
            heartbeat.join()
            self._settle(study, name, trial.number)
            raise
        candidate = _Candidate(trial, config, trial.user_attrs.get(SOURCE_ATTR, "sampler"), reasons, heartbeat)
        if not reasons and self.backend.lookahead and self.db.trial_by_config(name, config) is None:
            self.backend.prefetch(problem, config)
        return candidate

    def _run(self, study, problem: Problem, name: str, candidate: "_Candidate") -> str:
        """Claim, measure and store one candidate, and tell Optuna: "measured", "stopped", or a
        claim's other outcome ("repeat", "pruned", "full", "lost")."""
        trial, config = candidate.trial, candidate.config
        told = False
        try:
            verdict = self._claim(study, name, problem, candidate)
            if verdict != "claimed":
                told = True
                return verdict
            measurement = self._measure(study, trial, problem, config)
            try:
                self.db.add_trial(
                    run_id=self.run.run_id, study_name=name, optuna_number=trial.number, kernel=self.kernel.name,
                    kernel_hash=self.run.kernel_hash, target=self.target.name, problem=problem, config=config,
                    measurement=measurement, source=candidate.source, provenance=self.provenance,
                    offer_best=not self.backend.confirms_best,
                )
            except DuplicateTrial:
                # This worker was taken for dead and its trial handed back, and the config was stored
                # by another worker meanwhile: the stored one stands.
                _tell_stored(study, trial.number, self.db.trial_by_config(name, config))
                told = True
                return "repeat"
            _tell(study, trial.number, measurement.status, measurement.time_ms)
            told = True
            return "stopped" if measurement.status == "stopped" else "measured"
        finally:
            candidate.heartbeat.join()
            if not told:  # interrupted or crashed before Optuna heard of the trial
                self._settle(study, name, trial.number)

    def _measure(self, study, trial, problem: Problem, config: dict) -> Measurement:
        options = {}
        if self.backend.multi_fidelity:
            def should_stop(cheap_ms: float) -> str | None:
                trial.report(cheap_ms, step=0)
                return study.pruner.explain(study, cheap_ms) if trial.should_prune() else None

            options["should_stop"] = should_stop
        try:
            return self.backend.measure(problem, config, **options)
        except BackendUnavailable:
            raise  # nothing more can be measured: stop the search, keep what is stored
        except Exception as exc:  # a backend failure is the candidate's, not the search's
            return Measurement(status="failed", reason=f"{type(exc).__name__}: {exc}")

    def _confirm(self, problem: Problem, name: str) -> None:
        """Time the best few again, side by side, and store the fastest as the best config."""
        top = self.db.top_trials(name, self.backend.confirm_count)
        if not top:
            return
        # The default is timed with them (when it ran correctly): a config replaces it only when it is
        # faster by more than the backend's min_gain, and in each of the same interleaved rounds.
        default = self.db.trial_by_config(name, self.space.default_config(problem, self.target))
        if default is not None and default["status"] == "ok" and all(t["id"] != default["id"] for t in top):
            top.append(default)
        measurements = self.backend.confirm(problem, [self.kernel.config(t["config"]) for t in top])
        clocks = next((m.details.get("clocks") for m in measurements if m.details.get("clocks")), None)
        if clocks:
            self.db.add_clocks(self.run.run_id, clocks)
        self.db.confirm_best(run_id=self.run.run_id, study_name=name, kernel=self.kernel.name,
                             kernel_hash=self.run.kernel_hash, target=self.target.name, problem=problem,
                             confirmed=list(zip(top, measurements)),
                             prefer=default["id"] if default is not None else None,
                             min_gain=self.backend.min_gain,
                             provenance={**self.provenance, "confirmed": {
                                 "candidates": len(top), "rounds": measurements[0].details.get("confirm_rounds"),
                                 "clocks": clocks}})

    def _settle(self, study, name: str, number: int) -> None:
        """Finish an Optuna trial from the results DB: its stored outcome, or failed if none."""
        stored = self.db.trial_by_number(name, number)
        if stored is not None:
            _tell_stored(study, number, stored)
        else:
            self._fail_unmeasured(study, name, number)

    def _fail_unmeasured(self, study, name: str, number: int) -> None:
        """Fail a trial that was asked for but never measured. A grid search's point is failed and
        queued again under the study's lock, so that no worker judges the grid exhausted between
        the two (_grid_left)."""
        if self.job.sampler.name != "grid":
            self._fail_and_requeue(study, number)
            return
        with self.db.locked(name):
            self._fail_and_requeue(study, number)

    def _fail_and_requeue(self, study, number: int) -> None:
        """_fail_unmeasured's body, for a caller that holds the study's lock. A grid point is queued
        again: the grid sampler counts a failed trial's point as visited and would never propose it
        again."""
        import optuna

        study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        grid = self._grids.get(study.study_name)
        if grid is not None:
            grid.requeue(number)

    def _enqueue_starts(self, study, problem: Problem, name: str) -> None:
        """The default first, then the best configs of the nearest tuned problems (warm start), then
        one-knob changes of the default (probes, ComposedSpace.probes), each
        once however many workers start together: under the study's lock, a config is queued only
        when it is neither stored nor queued nor running. Whether one is done already is the
        results DB's to say: an Optuna trial that was asked and then lost to a kill does not count."""
        import optuna

        domains = self.space.domains(problem, self.target)
        neighbours = self._neighbours(problem, domains) if self.job.warm_start else []
        probes = self.space.probes(problem, self.target, self.job.probes)  # (CPU work: not under the lock)
        with self.db.locked(name) as lock:
            active = []
            for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,
                                                              optuna.trial.TrialState.RUNNING)):
                params = queued_params(t)
                if len(params) == len(domains):  # a RUNNING trial may be half suggested
                    active.append(config_key(self.space.full_config(problem, self.target, params)))

            def enqueue(params: dict, source: str) -> None:
                config = self.space.full_config(problem, self.target, params)
                if lock.stored(config) is None and config_key(config) not in active:
                    study.enqueue_trial(params, user_attrs={SOURCE_ATTR: source})
                    active.append(config_key(config))

            enqueue(self.space.default_params(problem, self.target), "default")
            for params in neighbours:
                enqueue(params, "warm-start")
            for params in probes:
                enqueue(params, "probe")

    def _neighbours(self, problem: Problem, domains: dict) -> list[dict]:
        """The params of the best configs of the nearest tuned problems (at most job.warm_start), in
        the order policy.for_warm_start gives (of the problem's dtype or its sibling's, as the runtime
        lookup borrows)."""
        entries = [(entry, self.kernel.problem(entry.problem))
                   for entry in self.db.best_configs(kernel=self.kernel.name, target=self.target.name)]
        seen = []
        for lender in policy.for_warm_start(policy.lenders(problem, entries, self.run.kernel_hash)):
            # A config stored before a knob existed ran with that knob at its schema default.
            try:
                config = self.kernel.config(lender.entry.config).canonical().to_dict()
            except self.kernel.config_error:  # a knob this kernel no longer has: its other knobs may do
                config = dict(lender.entry.config)
            params = {k: config[k] for k in domains if k in config}
            if len(params) != len(domains) or params in seen:
                continue
            if not all(domains[k].contains(v) for k, v in params.items()):
                continue
            seen.append(params)
            if len(seen) >= self.job.warm_start:
                break
        return seen

def _tell(study, number: int, status: str, time_ms: float | None) -> None:
    import optuna

    state = optuna.trial.TrialState
    if status == "ok":
        study.tell(number, time_ms, skip_if_finished=True)
    elif status in ("pruned", "stopped"):  # a stopped trial's cheap value was reported to Optuna
        study.tell(number, state=state.PRUNED, skip_if_finished=True)
    else:  # failed or wrong: samplers must not learn a time from it
        study.tell(number, state=state.FAIL, skip_if_finished=True)


def _tell_stored(study, number: int, stored: dict) -> None:
    _tell(study, number, stored["status"], stored["time_ms"])


@dataclass
class _Candidate:
    trial: object  # optuna.Trial
    config: dict
    source: str
    reasons: list[str]  # why it is infeasible; empty when it may be measured
    heartbeat: object  # Optuna's heartbeat thread of the trial (a no-op on storages without)


def _progress_bar(problem: Problem, total: int | None, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=problem.key(), unit="trial", leave=True, dynamic_ncols=True)
