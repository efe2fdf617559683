"""A search run as its workers share it (RunRef), and each problem's outcome as the results DB has
it over all workers and sessions (ProblemResult, read and said by ResultsReport): the search process
and the coordinator of worker processes report problems alike."""

from __future__ import annotations

from dataclasses import dataclass

from ..db import ResultsDB
from ..problem import Problem
from ..space import ComposedSpace
from .job import Job
from .studies import study_name


@dataclass(frozen=True)
class RunRef:
    """What every worker of a run shares: the job, the run and its study names, the budgets."""

    job: Job
    run_id: int
    prefix: str
    kernel_hash: str
    target: object
    budget_trials: int | None
    budget_seconds: float | None
    shared: bool  # several workers (or hosts) may share the studies
    l2_flush: str  # the L2 flush its times are taken under (provenance.l2_flush)

    def study_name(self, space: ComposedSpace, problem: Problem) -> str:
        return study_name(self.prefix, space.signature(), problem.key())


@dataclass
class ProblemResult:
    """One problem of a search as it ended: counts over all sessions and workers, why it stopped,
    and (from ResultsReport.summary_line) its default's and best config's times."""

    problem: Problem
    study_name: str
    measured: int = 0  # configs measured in this study, over all sessions and workers
    stopped_early: int = 0  # of those, stopped by the pruner after the cheap measurement
    pruned: int = 0
    repeats: int = 0
    stopped: str = ""
    default_ms: float | None = None
    best_ms: float | None = None
    best_tflops: float | None = None
    best_config: dict | None = None


class ResultsReport:
    """Each problem of a run as the results DB has it now: its counts, its default and best, and
    the line that says them."""

    def __init__(self, run: RunRef, space: ComposedSpace, db: ResultsDB) -> None:
        self.run, self.space, self.db = run, space, db
        self.kernel, self.target = run.job.kernel, run.target

    def counts(
        self, problem: Problem, name: str, result: ProblemResult | None = None
    ) -> ProblemResult:
        """The problem's counts as the results DB has them now (all workers, all sessions)."""
        result = result or ProblemResult(problem=problem, study_name=name)
        counts = self.db.study_counts(name)
        result.pruned = counts.pop("pruned", 0)
        result.measured = sum(counts.values())
        result.stopped_early = counts.get("stopped", 0)
        return result

    def best(self, problem: Problem):
        """The run's kernel's best config of the problem, or None."""
        for entry in self.db.best_configs(
            kernel=self.kernel.name, kernel_hash=self.run.kernel_hash, target=self.target.name
        ):
            if entry.problem_key == problem.key():
                return entry
        return None

    def summary_line(self, problem: Problem, result: ProblemResult, is_estimate: bool) -> str:
        """Fill in the result's default and best, and say them in one line."""
        best = self.best(problem)
        default = self.space.default_config(problem, self.target).to_dict()
        stored_default = self.db.trial_by_config(result.study_name, default)
        if stored_default is not None and stored_default["status"] == "ok":
            result.default_ms = stored_default["time_ms"]
        if best is not None:
            result.best_ms, result.best_tflops = best.time_ms, best.tflops
            result.best_config = best.config
        estimate = " (estimate)" if is_estimate else ""
        if best is None:
            line = "no feasible config measured"
        else:
            speedup = (
                f", {result.default_ms / best.time_ms:.3f}x the default"
                if result.default_ms
                else ""
            )
            changed = {k: v for k, v in best.config.items() if default.get(k) != v}
            line = (
                f"best {best.time_ms:.4g} ms = {best.tflops:.0f} TFLOP/s{estimate}{speedup}; "
                f"changed from default: {changed or 'nothing'}"
            )
        early = f" ({result.stopped_early} stopped early)" if result.stopped_early else ""
        return (
            f"{problem.key()}: {line} [{result.measured} measured{early}, "
            f"{result.pruned} pruned; {result.stopped}]"
        )
