"""The search job: one Optuna study per problem. The kernel's default config is measured first, the
best configs of tuned neighbours next (warm start), then the sampler's suggestions. Every suggestion
passes the union of the spaces' and the kernel's checks before the backend sees it; infeasible ones
are stored with their reasons and told to Optuna as pruned. Every finished trial is in the results DB
before Optuna hears of it, so a kill loses nothing that finished and `resume` picks up the studies."""

from __future__ import annotations

import time
import warnings
from collections import deque
from dataclasses import dataclass, field
from importlib import metadata

from . import __version__
from .db import ResultsDB, resolve_location
from .errors import BackendError, BackendUnavailable, KernelError
from .job import Job
from .measure.base import Backend, Measurement, make_backend, resolve_backend_name
from .problem import Problem
from .space import ComposedSpace, compose
from .studies import (default_storage_location, make_sampler, open_storage, problem_seed, quiet_optuna,
                      study_name)
from .target import get_target

SOURCE_ATTR = "fa4tune_source"
# A sampler that keeps proposing configs it has already seen has converged on this problem.
MAX_CONSECUTIVE_REPEATS = 25


@dataclass
class ProblemResult:
    problem: Problem
    study_name: str
    measured: int = 0  # configs measured in this study, over all sessions
    stopped_early: int = 0  # of those, stopped by the pruner after the cheap measurement
    pruned: int = 0
    repeats: int = 0
    stopped: str = ""
    default_ms: float | None = None
    best_ms: float | None = None
    best_tflops: float | None = None
    best_config: dict | None = None


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


class SearchInterrupted(Exception):
    """Ctrl-C or SIGTERM during a search; every finished trial is stored."""

    def __init__(self, summary: SearchSummary) -> None:
        super().__init__("search interrupted")
        self.summary = summary


def _versions() -> dict:
    def version(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    return {"dsl_version": version("nvidia-cutlass-dsl"), "torch_version": version("torch"),
            "fa4tune_version": __version__}


def _choose_target(job: Job, override):
    """The model backend's target (the gpu backend's is the GPU its worker sees)."""
    if override is not None:
        return get_target(override)
    return job.target or get_target(None)


def run_search(job: Job, *, db: str | None = None, storage: str | None = None, resume: bool = False,
               backend: str | Backend | None = None, target=None, trials: int | None = None,
               seconds: float | None = None, progress: bool = False, say=print) -> SearchSummary:
    """Run (or with `resume`, continue) a search job. Everything that can be checked is checked before
    the results DB or the Optuna storage is touched."""
    quiet_optuna()
    kernel = job.kernel
    if isinstance(backend, Backend):
        backend_name = backend.name
    else:
        backend_name = resolve_backend_name(backend or job.backend, announce=say)
    space = compose(kernel, job.spaces)
    if isinstance(backend, Backend):
        tgt = backend.target
    elif backend_name == "gpu":  # its worker finds the GPU (and refuses a job aimed at another)
        backend = make_backend("gpu", kernel, target if target is not None else job.target, announce=say,
                               **job.measure)
        tgt = backend.target
    else:
        tgt = _choose_target(job, target)
    try:
        unsupported = {p.key(): kernel.unsupported_reasons(p, tgt) for p in job.problems}
        unsupported = {k: r for k, r in unsupported.items() if r}
        if unsupported:
            lines = "; ".join(f"{k}: {', '.join(r)}" for k, r in unsupported.items())
            raise KernelError(f"{job.path}: no kernel supports these problems on {tgt.name}: {lines}")
        for problem in job.problems:  # sampler options and grid domains, before anything is written
            _sampler_for(job, space, problem, tgt)
    except BaseException:
        if isinstance(backend, Backend):
            backend.close()
        raise
    budget_trials = trials if trials is not None else job.budget.trials
    budget_seconds = seconds if seconds is not None else job.budget.seconds
    if not isinstance(backend, Backend):
        backend = make_backend(backend_name, kernel, tgt)

    db_location = resolve_location(db, job.db)
    results_db = ResultsDB.open(db_location, create=True)
    storage_location = storage or job.storage or default_storage_location(db_location)
    optuna_storage = open_storage(storage_location)
    kernel_hash = kernel.source_hash()

    previous = results_db.latest_run(job.name, kernel.name, kernel_hash, tgt.name) if resume else None
    if resume and previous is None:
        say(f"fa4tune: no earlier run of job {job.name!r} in {db_location}; starting a new one")
    provenance = {**backend.provenance(), **_versions()}
    if previous is not None:
        run_id, prefix = previous["id"], previous["study_prefix"]
        results_db.resume_run(run_id)
        say(f"fa4tune: resuming run {run_id} of job {job.name!r}")
    else:
        run_id = results_db.start_run(
            job_name=job.name, job_path=job.path, job_text=job.text, kernel=kernel.name,
            kernel_hash=kernel_hash, target=tgt.name, backend=backend.name, is_estimate=backend.is_estimate,
            gpu_name=provenance.get("gpu_name"), sm_count=provenance.get("sm_count"),
            cuda_driver=provenance.get("cuda_driver"), nvidia_driver=provenance.get("nvidia_driver"),
            cuda_version=provenance.get("cuda_version"), clocks=provenance.get("clocks"),
            dsl_version=provenance["dsl_version"],
            torch_version=provenance["torch_version"], fa4tune_version=__version__,
            storage_url=storage_location, study_prefix=f"{job.name}/run-pending",
        )
        prefix = f"{job.name}/{kernel.name}-{kernel_hash[:12]}/{tgt.name}/run{run_id}"
        results_db.set_study_prefix(run_id, prefix)
    if backend.is_estimate:
        say(f"fa4tune: backend {backend.name}: times are ESTIMATES of a cost model for {tgt.name}, "
            "not measurements")
    best_provenance = {"backend": backend.name, "gpu_name": provenance.get("gpu_name"),
                       "dsl_version": provenance["dsl_version"], "torch_version": provenance["torch_version"],
                       "fa4tune_version": __version__, "run": run_id}
    for key in ("cuda_version", "nvidia_driver"):
        if provenance.get(key):
            best_provenance[key] = provenance[key]
    summary = SearchSummary(run_id=run_id, db_location=db_location, storage=storage_location,
                            backend=backend.name, target=tgt.name, is_estimate=backend.is_estimate,
                            resumed=previous is not None)
    context = _Context(job, kernel, kernel_hash, tgt, space, backend, results_db, optuna_storage, run_id,
                       prefix, best_provenance, budget_trials, budget_seconds, resume, progress, say)
    try:
        for problem in job.problems:
            summary.results.append(context.tune(problem))
    except KeyboardInterrupt:
        results_db.finish_run(run_id, "interrupted")
        backend.close()
        raise SearchInterrupted(summary) from None
    except BaseException:
        results_db.finish_run(run_id, "failed")
        backend.close()
        raise
    backend.close()
    results_db.finish_run(run_id, "finished")
    if job.export:
        from .tables import export_table

        summary.exported = export_table(results_db, job.export, kernel=kernel, target=tgt.name)
    results_db.close()
    return summary


def _sampler_for(job: Job, space: ComposedSpace, problem: Problem, target):
    grid = space.grid(problem, target) if job.sampler.name == "grid" else None
    return make_sampler(job.sampler, problem_seed(job.seed, problem.key()), grid=grid,
                        where=f"{job.path}: sampler")


@dataclass
class _Context:
    job: Job
    kernel: object
    kernel_hash: str
    target: object
    space: ComposedSpace
    backend: Backend
    db: ResultsDB
    storage: object
    run_id: int
    prefix: str
    provenance: dict
    budget_trials: int | None
    budget_seconds: float | None
    resume: bool
    progress: bool
    say: object

    def tune(self, problem: Problem) -> ProblemResult:
        import optuna

        name = study_name(self.prefix, self.space.signature(), problem.key())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study = optuna.create_study(study_name=name, storage=self.storage, direction="minimize",
                                        sampler=_sampler_for(self.job, self.space, problem, self.target),
                                        pruner=self.backend.make_pruner() or optuna.pruners.NopPruner(),
                                        load_if_exists=True)
        if self.resume:
            self._recover_unfinished(study, name)
        self._enqueue_starts(study, problem, name)
        measured = self.db.count_trials(name, measured_only=True)
        result = ProblemResult(problem=problem, study_name=name, measured=measured,
                               stopped_early=self.db.count_trials(name, status="stopped"),
                               pruned=self.db.count_trials(name, measured_only=False) - measured)
        size = self.space.size(problem, self.target)
        bar = _progress_bar(problem, self.budget_trials, result.measured, self.progress)
        started = time.monotonic()
        consecutive_repeats = 0
        # Candidates asked of Optuna ahead of their measurement, so that the backend can compile them
        # while it measures the current one (lookahead 0: one at a time).
        queue: deque[_Candidate] = deque()
        try:
            while True:
                stop = self._stop_reason(result, size, started, consecutive_repeats, name)
                if stop:
                    result.stopped = stop
                    break
                while len(queue) < 1 + self.backend.lookahead:
                    queue.append(self._ask(study, problem, name))
                outcome = self._run(study, problem, name, queue.popleft())
                if outcome == "repeat":
                    result.repeats += 1
                    consecutive_repeats += 1
                    continue
                consecutive_repeats = 0
                if outcome == "pruned":
                    result.pruned += 1
                else:
                    result.measured += 1
                    result.stopped_early += outcome == "stopped"
                    if bar is not None:
                        bar.update(1)
                if bar is not None:
                    top = self.db.top_trials(name, 1)
                    shown = f"best {top[0]['tflops']:.0f} TFLOP/s" if top else "no feasible config yet"
                    bar.set_postfix_str(f"{shown}, pruned {result.pruned}")
        finally:
            for candidate in queue:  # asked but never measured: nothing to learn from them
                study.tell(candidate.trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
            if bar is not None:
                bar.close()
        if self.backend.confirms_best and not self.db.confirmed(name):
            self._confirm(problem, name)
        self._summarise(problem, result)
        return result

    def _stop_reason(self, result: ProblemResult, size, started, consecutive_repeats, name) -> str:
        if self.budget_trials is not None and result.measured >= self.budget_trials:
            return f"trial budget ({self.budget_trials}) reached"
        if self.budget_seconds is not None and time.monotonic() - started >= self.budget_seconds:
            return f"time budget ({self.budget_seconds:g} s) reached"
        if size is not None and self.db.count_trials(name, measured_only=False) >= size:
            return f"space exhausted (all {size} configs tried)"
        if result.pruned >= self.job.budget.pruned_cap:
            return f"{result.pruned} infeasible suggestions; the space is mostly infeasible for this problem"
        if consecutive_repeats >= MAX_CONSECUTIVE_REPEATS:
            return "converged (the sampler only proposes configs already tried)"
        return ""

    def _ask(self, study, problem: Problem, name: str) -> "_Candidate":
        """Ask Optuna for the next config and check it; a feasible new one is handed to the
        backend to prepare (compile) while earlier candidates are measured."""
        trial = study.ask()
        try:
            params = self.space.suggest(trial, problem, self.target)
            config = self.space.full_config(problem, self.target, params)
            reasons = self.space.check(problem, config, self.target)
        except BaseException:
            self._settle(study, name, trial.number)
            raise
        candidate = _Candidate(trial, config, trial.user_attrs.get(SOURCE_ATTR, "sampler"), reasons)
        if not reasons and self.backend.lookahead and self.db.trial_by_config(name, config) is None:
            self.backend.prefetch(problem, self.kernel.make_config(config))
        return candidate

    def _run(self, study, problem: Problem, name: str, candidate: "_Candidate") -> str:
        """Measure (or prune) one candidate, store it, tell Optuna: "measured", "stopped", "pruned"
        or "repeat" (a config already stored in this study: Optuna hears its earlier outcome)."""
        trial, config = candidate.trial, candidate.config
        told = False
        try:
            earlier = self.db.trial_by_config(name, config)
            if earlier is not None:  # never measure a config twice: tell Optuna what it gave before
                _tell_stored(study, trial.number, earlier)
                told = True
                return "repeat"
            if candidate.reasons:
                measurement = Measurement.pruned(candidate.reasons)
            else:
                measurement = self._measure(study, trial, problem, config)
            self.db.add_trial(
                run_id=self.run_id, study_name=name, optuna_number=trial.number, kernel=self.kernel.name,
                kernel_hash=self.kernel_hash, target=self.target.name, problem=problem, config=config,
                measurement=measurement, source=candidate.source, provenance=self.provenance,
                offer_best=not self.backend.confirms_best,
            )
            _tell(study, trial.number, measurement.status, measurement.time_ms)
            told = True
            return {"pruned": "pruned", "stopped": "stopped"}.get(measurement.status, "measured")
        finally:
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
            return self.backend.measure(problem, self.kernel.make_config(config), **options)
        except BackendUnavailable:
            raise  # nothing more can be measured: stop the search, keep what is stored
        except Exception as exc:  # a backend failure is the candidate's, not the search's
            return Measurement(status="failed", reason=f"{type(exc).__name__}: {exc}")

    def _confirm(self, problem: Problem, name: str) -> None:
        """Time the best few again, side by side, and store the fastest as the best config."""
        top = self.db.top_trials(name, self.backend.confirm_count)
        if not top:
            return
        measurements = self.backend.confirm(problem, [t["config"] for t in top])
        clocks = next((m.details.get("clocks") for m in measurements if m.details.get("clocks")), None)
        if clocks:
            self.db.add_clocks(self.run_id, clocks)
        self.db.confirm_best(run_id=self.run_id, study_name=name, kernel=self.kernel.name,
                             kernel_hash=self.kernel_hash, target=self.target.name, problem=problem,
                             confirmed=list(zip(top, measurements)),
                             provenance={**self.provenance, "confirmed": {
                                 "candidates": len(top), "rounds": measurements[0].details.get("confirm_rounds"),
                                 "clocks": clocks}})

    def _settle(self, study, name: str, number: int) -> None:
        """Finish an Optuna trial from the results DB: its stored outcome, or failed if none."""
        import optuna

        stored = self.db.trial_by_number(name, number)
        if stored is not None:
            _tell_stored(study, number, stored)
        else:
            study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)

    def _recover_unfinished(self, study, name: str) -> None:
        """Trials left RUNNING by a killed search (single worker: nobody else is running them)."""
        import optuna

        for frozen in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            self._settle(study, name, frozen.number)

    def _enqueue_starts(self, study, problem: Problem, name: str) -> None:
        """The default first, then the best configs of the nearest tuned problems (warm start).
        Whether one is done already is the results DB's to say: an Optuna trial that was asked and
        then lost to a kill does not count."""
        import optuna

        domains = self.space.domains(problem, self.target)
        waiting = [t.system_attrs.get("fixed_params", {}) for t in
                   study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))]

        def enqueue(params: dict, source: str) -> None:
            config = self.space.full_config(problem, self.target, params)
            if self.db.trial_by_config(name, config) is None and params not in waiting:
                study.enqueue_trial(params, user_attrs={SOURCE_ATTR: source})
                waiting.append(params)

        enqueue(self.space.default_params(problem, self.target), "default")
        if not self.job.warm_start:
            return
        bucket = problem.bucket()
        neighbours = []
        for entry in self.db.best_configs(kernel=self.kernel.name, target=self.target.name):
            other = Problem.from_dict(entry.problem)
            distance = bucket.distance(other.bucket())
            if distance != float("inf"):
                current = entry.kernel_hash == self.kernel_hash
                neighbours.append((distance, not current, entry.problem_key, entry.config))
        seen = []
        for _, _, _, config in sorted(neighbours, key=lambda n: n[:3]):
            params = {k: config[k] for k in domains if k in config}
            if len(params) != len(domains) or params in seen:
                continue
            if not all(domains[k].contains(v) for k, v in params.items()):
                continue
            seen.append(params)
            enqueue(params, "warm-start")
            if len(seen) >= self.job.warm_start:
                break

    def _best(self, problem: Problem):
        for entry in self.db.best_configs(kernel=self.kernel.name, kernel_hash=self.kernel_hash,
                                          target=self.target.name):
            if entry.problem_key == problem.key():
                return entry
        return None

    def _summarise(self, problem: Problem, result: ProblemResult) -> None:
        best = self._best(problem)
        default = self.space.full_config(problem, self.target, self.space.default_params(problem, self.target))
        stored_default = self.db.trial_by_config(result.study_name, default)
        if stored_default is not None and stored_default["status"] == "ok":
            result.default_ms = stored_default["time_ms"]
        if best is not None:
            result.best_ms, result.best_tflops, result.best_config = best.time_ms, best.tflops, best.config
        estimate = " (estimate)" if self.backend.is_estimate else ""
        if best is None:
            line = "no feasible config measured"
        else:
            speedup = f", {result.default_ms / best.time_ms:.3f}x the default" if result.default_ms else ""
            changed = {k: v for k, v in best.config.items() if default.get(k) != v}
            line = (f"best {best.time_ms:.4g} ms = {best.tflops:.0f} TFLOP/s{estimate}{speedup}; "
                    f"changed from default: {changed or 'nothing'}")
        early = f" ({result.stopped_early} stopped early)" if result.stopped_early else ""
        self.say(f"{problem.key()}: {line} [{result.measured} measured{early}, {result.pruned} pruned; "
                 f"{result.stopped}]")


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


def _progress_bar(problem: Problem, total: int | None, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=problem.key(), unit="trial", leave=True, dynamic_ncols=True)
