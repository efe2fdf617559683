"""One problem's study as the workers of a run share it. What must happen once happens under the
study's lock in the results DB (`ResultsDB.locked`), where a worker:
  - claims a candidate before measuring it: a config stored already is a repeat (Optuna hears the
    stored outcome), one another worker is measuring is a repeat too, and a budget slot is taken
    only while stored measurements plus claims in flight stay below the budget. The claim is the
    trial's CLAIM_ATTR in Optuna: it holds its slot while the trial is RUNNING, and a dead worker's
    claim passes to the trial's queued copy when it is handed back (studies.py), which keeps the
    slot for whoever measures it. The default config, queued, keeps a slot too, claimed or not: it
    is the baseline of every "x the default", so fresh trials never take the budget's last slot
    from it (a worker that died after asking for it, before claiming it, leaves a copy without a
    claim);
  - hands back the trials of dead workers (their stored outcome told to Optuna, or failed and queued
    again by Optuna's retry callback);
  - fails a trial it asked for but never measured (a grid point is queued again with it, Grid);
  - takes the study's confirmation (the re-timing of its best few), which one worker does.
The results DB also refuses a second search trial of one config in a study (DuplicateTrial)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ..db import ResultsDB, config_key
from ..measure.base import Measurement
from ..problem import Problem
from .grid import Grid, GridState
from .run import RunRef
from .studies import (
    CLAIM_ATTR,
    DEFAULT_SOURCE,
    SOURCE_ATTR,
    WORKER_ATTR,
    fail_stale,
    give_back,
    hand_back,
    tell_outcome,
    tell_stored,
    trial_orphaned,
    worker_gone,
)

# Optuna is imported where it is used, as in studies.py.


class Claim(Enum):
    """How a worker's claim of a candidate ended (SharedStudy.claim)."""

    CLAIMED = "claimed"  # the worker holds a budget slot for it: measure it
    REPEAT = "repeat"  # stored already, or being measured by another worker; Optuna has heard
    PRUNED = "pruned"  # infeasible: stored and told
    FULL = "full"  # no budget slot left: the trial went back to the queue, or failed
    LOST = "lost"  # another worker handed this trial back


@dataclass
class Candidate:
    """A trial asked of Optuna, and its config, on its way to a claim and a measurement."""

    trial: object  # optuna.Trial
    config: dict
    source: str
    reasons: list[str]  # why it is infeasible; empty when it may be measured
    heartbeat: object  # studies.Heartbeat of the trial (a no-op on storages without heartbeats)


@dataclass(frozen=True)
class TrialRecorder:
    """How a worker stores the trials of one problem in the results DB: the run's columns, the
    problem, and where the worker's measurements come from."""

    run: RunRef
    problem: Problem
    provenance: dict
    is_estimate: bool

    def add(
        self, store, number: int, candidate: Candidate, measurement: Measurement, **options
    ) -> None:
        """Store the candidate's trial through `store`: the results DB (options: study_name,
        offer_best) or, under the study's lock, the LockedStudy."""
        store.add_trial(
            run_id=self.run.run_id,
            optuna_number=number,
            kernel=self.run.job.kernel.name,
            kernel_hash=self.run.kernel_hash,
            target=self.run.target.name,
            problem=self.problem,
            config=candidate.config,
            measurement=measurement,
            source=candidate.source,
            provenance=self.provenance,
            **options,
        )


class SharedStudy:
    """The study `name` (an Optuna study, `study`) as the worker `worker` shares it with the run's
    other workers, through the results DB `db`. `grid`: its points, in a grid search. `recorder`
    stores the infeasible candidates that a claim prunes (a worker that measures has one)."""

    def __init__(
        self,
        run: RunRef,
        db: ResultsDB,
        name: str,
        study,
        worker: str,
        grid: Grid | None = None,
        recorder: TrialRecorder | None = None,
    ) -> None:
        self.run, self.db, self.name, self.study, self.worker = run, db, name, study, worker
        self.grid, self.recorder = grid, recorder

    # ---- budget slots ---------------------------------------------------------------------------
    def in_flight(
        self, stored_among, trials=None, exclude: int | None = None, reserved: bool = True
    ) -> list:
        """The claims that hold budget slots: trials being measured (RUNNING, claimed, not stored
        yet) and, with `reserved`, the queued trials (WAITING) that keep a slot for whoever measures
        them: dead workers' trials queued again with their claim, and the default config however
        it was queued. `stored_among(numbers)`: which of these trial numbers the results DB has."""
        import optuna

        running = optuna.trial.TrialState.RUNNING
        waiting = optuna.trial.TrialState.WAITING
        states = (running,) + ((waiting,) if reserved else ())
        if trials is None:
            trials = self.study.get_trials(deepcopy=False, states=states)
        claimed = [
            t
            for t in trials
            if t.state in states
            and t.number != exclude
            and (
                CLAIM_ATTR in t.user_attrs
                or (t.state == waiting and t.user_attrs.get(SOURCE_ATTR) == DEFAULT_SOURCE)
            )
        ]
        stored = stored_among([t.number for t in claimed if t.state == running])
        return [t for t in claimed if t.number not in stored]

    def measuring(self, trials=None) -> list:
        """Claimed trials being measured now (by any worker); `trials`: the study's, if read."""
        return self.in_flight(
            lambda numbers: self.db.stored_among(self.name, numbers), trials=trials, reserved=False
        )

    def still_running(self) -> bool:
        """Whether a claimed trial is being measured (by any worker), or another worker (or an
        unnamed search) holds a RUNNING trial of the study: one read of the study's running
        trials for both."""
        import optuna

        running = self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        if self.measuring(trials=running):
            return True
        return any(t.user_attrs.get(WORKER_ATTR) != self.worker for t in running)

    def slot_free(self, measured: int) -> bool:
        """Whether a budget slot is free now beside `measured` stored measurements, or kept for a
        handed-back trial that this worker may pick up (a hint: the claim decides, under the
        lock)."""
        if self.run.budget_trials is None:
            return True
        return measured + len(self.measuring()) < self.run.budget_trials

    def claim(self, candidate: Candidate) -> Claim:
        """Under the study's lock: whether this worker measures the candidate (CLAIMED) or what
        became of it instead."""
        import optuna

        trial, config, study = candidate.trial, candidate.config, self.study
        with self.db.locked(self.name) as lock:
            active = study.get_trials(
                deepcopy=False,
                states=(optuna.trial.TrialState.RUNNING, optuna.trial.TrialState.WAITING),
            )
            mine = next((t for t in active if t.number == trial.number), None)
            if (
                mine is None
                or mine.state != optuna.trial.TrialState.RUNNING
                or mine.user_attrs.get(WORKER_ATTR) != self.worker
            ):
                return Claim.LOST
            earlier = lock.stored(config)
            if earlier is not None:  # never measure a config twice: tell Optuna what it gave before
                tell_stored(study, trial.number, earlier)
                return Claim.REPEAT
            if candidate.reasons:
                measurement = Measurement.pruned(
                    candidate.reasons, is_estimate=self.recorder.is_estimate
                )
                self.recorder.add(lock, trial.number, candidate, measurement)
                tell_outcome(study, trial.number, "pruned", None)
                return Claim.PRUNED
            key = config_key(config)
            in_flight = self.in_flight(lock.stored_among, active, exclude=trial.number)
            if any(t.user_attrs.get(CLAIM_ATTR) == key for t in in_flight):
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
                return Claim.REPEAT
            budget = self.run.budget_trials
            if budget is not None and lock.measured() + len(in_flight) >= budget:
                if "fixed_params" in mine.system_attrs or "failed_trial" in mine.system_attrs:
                    give_back(study, mine)  # a queued config: another worker (or pass) takes it
                else:
                    self.fail(trial.number)
                return Claim.FULL
            trial.set_user_attr(CLAIM_ATTR, key)
            return Claim.CLAIMED

    # ---- trials that end unmeasured -------------------------------------------------------------
    def recover(self, dead: frozenset = frozenset()) -> None:
        """Hand back what dead workers left RUNNING (`dead`: worker names known dead): its stored
        outcome told to Optuna, else the trial failed and queued again. Trials of another host
        are judged by Optuna's heartbeat (server storages)."""
        import optuna

        with self.db.locked(self.name) as lock:
            fail_stale(self.study)
            for frozen in self.study.get_trials(
                deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)
            ):
                if frozen.user_attrs.get(WORKER_ATTR) == self.worker or not trial_orphaned(
                    frozen, self.run.shared, dead
                ):
                    continue
                stored = lock.stored_number(frozen.number)
                if stored is not None:
                    tell_stored(self.study, frozen.number, stored)
                else:
                    hand_back(self.study, frozen)

    def settle(self, number: int) -> None:
        """Finish an Optuna trial from the results DB: its stored outcome, or failed if none."""
        stored = self.db.trial_by_number(self.name, number)
        if stored is not None:
            tell_stored(self.study, number, stored)
        else:
            self.fail_unmeasured(number)

    def fail_unmeasured(self, number: int) -> None:
        """Fail a trial that was asked for but never measured. A grid search's point is failed and
        queued again under the study's lock, so that no worker judges the grid exhausted between
        the two (grid_state)."""
        if self.grid is None:
            self.fail(number)
            return
        with self.db.locked(self.name):
            self.fail(number)

    def fail(self, number: int) -> None:
        """fail_unmeasured's body, for a caller that holds the study's lock. A grid point is queued
        again: the grid sampler counts a failed trial's point as visited and would never propose
        it again."""
        import optuna

        self.study.tell(number, state=optuna.trial.TrialState.FAIL, skip_if_finished=True)
        if self.grid is not None:
            self.grid.requeue(number)

    def grid_state(self, confirm_done: bool = False) -> GridState:
        """What is left of a grid search's points (OPEN for a search of another sampler). With
        `confirm_done`, DONE is read again under the study's lock, where a failed point and its
        queued copy are written together."""
        if self.grid is None:
            return GridState.OPEN
        state = self.grid.state()
        if state is GridState.DONE and confirm_done:
            with self.db.locked(self.name):
                state = self.grid.state()
        return state

    # ---- the confirmation -----------------------------------------------------------------------
    def claim_confirmation(self) -> bool:
        """Whether this worker re-times the study's best few (one worker does, unless it died)."""
        with self.db.locked(self.name) as lock:
            holder = lock.confirming()
            if self.db.confirmed(self.name) or (
                holder not in (None, self.worker) and not worker_gone(holder)
            ):
                return False
            lock.set_confirming(self.worker)
            return True

    def release_confirmation(self) -> None:
        with self.db.locked(self.name) as lock:
            if lock.confirming() == self.worker:
                lock.set_confirming(None)
