"""The loop of one search worker over the job's problems: the search process's own (one worker), or
one of many worker processes (workers.py) that share each problem's study through Optuna's storage
and the results DB (sharing.py)."""

from __future__ import annotations

import warnings

from ..db import ResultsDB
from ..measure.base import Backend
from ..problem import Problem
from ..space import ComposedSpace
from .job import Job
from .problem_search import ProblemSearch, ProblemState
from .run import ProblemResult, ResultsReport, RunRef
from .starts import StartingConfigs
from .studies import make_sampler, problem_seed, worker_name

# Optuna is imported where it is used, as in studies.py.


def problem_sampler(
    job: Job,
    space: ComposedSpace,
    problem: Problem,
    target,
    worker_seed: int = 0,
    shared: bool = False,
    earlier_trials: int = 0,
):
    """The problem's sampler. A study that already has trials (a resume, a restarted worker) gets a
    seed of its own: with the first session's, a random sampler replays the configs measured then,
    and a run of repeats reads as convergence."""
    grid = space.grid(problem, target) if job.sampler.name == "grid" else None
    seed = problem_seed(job.seed, problem.key(), worker_seed, earlier_trials)
    return make_sampler(
        job.sampler,
        seed,
        grid=grid,
        where=f"{job.path}: sampler",
        shared=shared,
        grid_seed=problem_seed(job.seed, problem.key()),
    )


class WorkerLoop:
    """One worker's search over the job's problems (the only worker, or one of many), measuring
    with `backend` and storing in `db`, its studies in the Optuna `storage`. `provenance`: what
    the best configs it stores record; `worker_seed`: its samplers' seed offset; `summarise`: say
    each problem's summary line when it is done."""

    def __init__(
        self,
        run: RunRef,
        space: ComposedSpace,
        backend: Backend,
        db: ResultsDB,
        storage,
        provenance: dict,
        progress: bool,
        say,
        worker_seed: int = 0,
        summarise: bool = True,
    ) -> None:
        self.run, self.job, self.kernel, self.target = run, run.job, run.job.kernel, run.target
        self.space, self.backend, self.db, self.storage = space, backend, db, storage
        self.provenance, self.progress, self.say = provenance, progress, say
        self.worker = worker_name()
        self.worker_seed = worker_seed
        self.summarise = summarise
        self.report = ResultsReport(run, space, db)
        self.starts = StartingConfigs(run, space, db)
        self.states: dict[str, ProblemState] = {}  # per study, over passes

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

    def tune(self, problem: Problem, wait: bool = True) -> ProblemResult | None:
        """One pass over one problem (ProblemSearch.tune); None when other workers still measure
        its last trials and `wait` is False (come back later)."""
        study = self.open_study(problem)
        name = study.study_name
        state = self.states.get(name)
        if state is None:
            # The time budget counts the seconds spent inside tune() on this problem, a resumed
            # run's earlier sessions included: a problem that spent it before the search stopped
            # stays done. (Not the time on other problems between tune_all's two passes.)
            spent = self.db.study_seconds(self.run.run_id, name)
            state = self.states[name] = ProblemState(spent=spent)
        return ProblemSearch(self, problem, study, state).tune(wait)

    def open_study(self, problem: Problem):
        """The problem's study, created or joined, with this worker's sampler for it."""
        import optuna

        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            pruner = self.backend.make_pruner() if self.backend else None
            study = optuna.create_study(
                study_name=self.run.study_name(self.space, problem),
                storage=self.storage,
                direction="minimize",
                sampler=optuna.samplers.RandomSampler(),  # replaced once its trials are counted
                pruner=pruner or optuna.pruners.NopPruner(),
                load_if_exists=True,
            )
            earlier = len(study.get_trials(deepcopy=False))
            study.sampler = problem_sampler(
                self.job,
                self.space,
                problem,
                self.target,
                self.worker_seed,
                self.run.shared,
                earlier,
            )
        return study
