"""The configs a problem's search measures before the sampler's: the kernel's default first, then
the best configs of the nearest tuned problems (warm start), then one-knob changes of the default
(probes, ComposedSpace.probes). Each is queued in the problem's study once, however many workers
start together."""

from __future__ import annotations

from .. import policy
from ..db import ResultsDB, config_key
from ..problem import Problem
from ..space import ComposedSpace
from .run import RunRef
from .studies import DEFAULT_SOURCE, SOURCE_ATTR, queued_params

# Optuna is imported where it is used, as in studies.py.


class StartingConfigs:
    """Queues a problem's starting configs in its study (`enqueue`), as the job asks for them
    (`warm_start`, `probes`), from the results DB's best configs of other problems."""

    def __init__(self, run: RunRef, space: ComposedSpace, db: ResultsDB) -> None:
        self.run, self.space, self.db = run, space, db
        self.job, self.kernel, self.target = run.job, run.job.kernel, run.target

    def enqueue(self, study, problem: Problem) -> None:
        """Under the study's lock, queue each config that is neither stored nor queued nor
        running. Whether one is done already is the results DB's to say: an Optuna trial that was
        asked and then lost to a kill does not count."""
        import optuna

        domains = self.space.domains(problem, self.target)
        neighbours = self.neighbours(problem, domains) if self.job.warm_start else []
        # (CPU work: not under the lock)
        probes = self.space.probes(problem, self.target, self.job.probes)
        with self.db.locked(study.study_name) as lock:
            active = []
            for t in study.get_trials(
                deepcopy=False,
                states=(optuna.trial.TrialState.WAITING, optuna.trial.TrialState.RUNNING),
            ):
                params = queued_params(t)
                if len(params) == len(domains):  # a RUNNING trial may be half suggested
                    active.append(config_key(self.space.full_config(problem, self.target, params)))

            def enqueue(params: dict, source: str) -> None:
                config = self.space.full_config(problem, self.target, params)
                if lock.stored(config) is None and config_key(config) not in active:
                    study.enqueue_trial(params, user_attrs={SOURCE_ATTR: source})
                    active.append(config_key(config))

            enqueue(self.space.default_params(problem, self.target), DEFAULT_SOURCE)
            for params in neighbours:
                enqueue(params, "warm-start")
            for params in probes:
                enqueue(params, "probe")

    def neighbours(self, problem: Problem, domains: dict) -> list[dict]:
        """The params of the best configs of the nearest tuned problems (at most job.warm_start),
        in the order policy.for_warm_start gives (of the problem's dtype or its sibling's, as the
        runtime lookup borrows)."""
        best = self.db.best_configs(kernel=self.kernel.name, target=self.target.name)
        entries = [(entry, self.kernel.problem(entry.problem)) for entry in best]
        seen = []
        for lender in policy.for_warm_start(policy.lenders(problem, entries, self.run.kernel_hash)):
            # A config stored before a knob existed ran with that knob at its schema default.
            try:
                config = self.kernel.config(lender.entry.config).canonical().to_dict()
            except self.kernel.config_error:  # a knob this kernel no longer has: its others may do
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
