"""One problem's search in one worker: ask Optuna for a candidate, claim it (sharing.py), measure
it, store it in the results DB, and only then tell Optuna, until a stop reason; then wait for the
other workers' last trials and confirm the best few. Every suggestion passes the union of the
spaces' and the kernel's checks before the backend sees it; infeasible ones are stored with their
reasons and told to Optuna as pruned."""

from __future__ import annotations

import time
import warnings
from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from .. import interrupts
from ..db import DuplicateTrial
from ..errors import BackendUnavailable
from ..measure.base import Measurement
from ..problem import Problem
from .grid import Grid, GridState
from .run import ProblemResult
from .sharing import Candidate, Claim, SharedStudy, TrialRecorder
from .studies import SOURCE_ATTR, WORKER_ATTR, Heartbeat, tell_outcome, tell_stored

if TYPE_CHECKING:
    from .loop import WorkerLoop

# Optuna and tqdm are imported where they are used: a search that needs neither (the model backend
# without a progress bar) does not pay for tqdm, and Optuna is imported as in studies.py.

# A sampler that keeps proposing configs it has already seen has converged on this problem (not the
# grid sampler: it asks for each point once, and its repeats are points that are one config).
MAX_CONSECUTIVE_REPEATS = 25
# How often a worker that waits for other workers' last trials of a problem looks again.
POLL_S = 0.2


class Outcome(Enum):
    """What became of one candidate (ProblemSearch.attempt)."""

    MEASURED = "measured"
    STOPPED = "stopped"  # measured, and stopped by the pruner after the cheap measurement
    REPEAT = Claim.REPEAT.value
    PRUNED = Claim.PRUNED.value
    FULL = Claim.FULL.value
    LOST = Claim.LOST.value


@dataclass
class ProblemState:
    """One worker's clock and counters of one problem, kept over WorkerLoop.tune_all's passes."""

    spent: float  # seconds spent on the problem before this pass (earlier sessions included)
    repeats: int = 0  # candidates that were configs tried already
    consecutive: int = 0  # of those, in a row since the last new config
    started: bool = False  # its study was recovered and its starting configs queued
    entered: float = 0.0  # time.monotonic() when this pass began

    def elapsed(self) -> float:
        """Seconds spent on the problem: earlier calls and sessions, and this call so far."""
        return self.spent + time.monotonic() - self.entered


class ProblemSearch:
    """One pass of a worker (`loop`) over one problem and its study, with the problem's `state`."""

    def __init__(self, loop: WorkerLoop, problem: Problem, study, state: ProblemState) -> None:
        self.loop, self.problem, self.study, self.state = loop, problem, study, state
        self.name = study.study_name
        self.run, self.job, self.target = loop.run, loop.job, loop.target
        self.backend, self.db, self.space = loop.backend, loop.db, loop.space
        self.study_id = loop.storage.get_study_id_from_name(self.name)
        grid = None
        if self.job.sampler.name == "grid":
            grid = Grid(study, loop.storage, self.study_id, self.space.grid(problem, self.target))
        self.recorder = TrialRecorder(self.run, problem, loop.provenance, self.backend.is_estimate)
        self.shared = SharedStudy(
            self.run, self.db, self.name, study, loop.worker, grid, self.recorder
        )
        # Trials this pass asked Optuna for and has not yet handed on (told, or given back by
        # the claim), with their heartbeats: whatever stops `search`, it settles those still
        # RUNNING as this worker's (settle_in_hand). A signal can land between any two of the
        # steps from asking to claiming, and a trial it catches there has nobody else to finish it.
        self.in_hand: dict[int, Heartbeat | None] = {}

    def tune(self, wait: bool) -> ProblemResult | None:
        """Search the problem until a stop reason, then confirm and summarise it; None when other
        workers still measure its last trials and `wait` is False (come back later)."""
        if not self.state.started:
            self.start()
        self.state.entered = time.monotonic()
        result = self.loop.report.counts(self.problem, self.name)
        result.repeats = self.state.repeats
        if not self.search(result, wait):
            return None
        # Others' trials still in flight: the best few are confirmed once all are in. A trial
        # another worker has asked for but not claimed holds no budget slot, yet is waited for
        # too (a live worker settles it at once, a dead one's goes stale and recover() fails it):
        # a finished problem leaves no trial RUNNING.
        while self.shared.still_running():
            interrupts.checkpoint()
            if not wait:
                return None
            time.sleep(POLL_S)
            self.shared.recover()
        if (
            self.backend.confirms_best
            and not self.db.confirmed(self.name)
            and self.shared.claim_confirmation()
        ):
            try:
                self.confirm()
            finally:  # done (or failed): trials measured later, by a resume or another host, too
                self.shared.release_confirmation()
        result = self.loop.report.counts(self.problem, self.name, result)
        if self.loop.summarise:
            self.loop.say(
                self.loop.report.summary_line(self.problem, result, self.backend.is_estimate)
            )
        return result

    def start(self) -> None:
        """The problem's first pass in this worker: dead workers' trials handed back, the starting
        configs queued, and the backend told of a config known to run."""
        self.shared.recover()
        self.loop.starts.enqueue(self.study, self.problem)
        # A resume whose first candidates kill the GPU worker checks the GPU with an earlier
        # session's config.
        kernel = self.job.kernel
        good = self.db.known_good_config(
            kernel=kernel.name,
            kernel_hash=self.run.kernel_hash,
            target=self.target.name,
            problem_key=self.problem.key(),
        )
        if good is not None:
            self.backend.note_stored_good(self.problem, good)
        self.state.started = True

    def search(self, result: ProblemResult, wait: bool) -> bool:
        """Ask, claim, measure and store candidates until a stop reason (in result.stopped):
        True; False when `wait` is False and the budget's or the grid's last trials are other
        workers' to measure."""
        state = self.state
        size = self.space.size(self.problem, self.target)
        bar = _progress_bar(
            self.problem, self.run.budget_trials, result.measured, self.loop.progress
        )
        # Candidates asked of Optuna ahead of their measurement, so that the backend can compile
        # them while it measures the current one (lookahead 0: one at a time).
        queue: deque[Candidate] = deque()
        try:
            while True:
                interrupts.checkpoint()  # a Ctrl-C that the garbage collector swallowed stops here
                # Other workers' trials count too.
                result = self.loop.report.counts(self.problem, self.name, result)
                stop = self.stop_reason(result, size)
                grid = GridState.OPEN
                if not stop and not queue:
                    grid = self.shared.grid_state(confirm_done=True)
                if grid is GridState.DONE:
                    stop = f"grid exhausted (all {self.shared.grid.size} points tried)"
                if stop:
                    result.stopped = stop
                    return True
                if not queue and (
                    grid is GridState.BUSY or not self.shared.slot_free(result.measured)
                ):
                    if not wait:
                        return False  # the budget or the grid's last points: others measure them
                    time.sleep(POLL_S)
                    self.shared.recover()
                    continue
                while len(queue) < 1 + self.backend.lookahead and (
                    not queue or self.shared.grid_state() is GridState.OPEN
                ):
                    queue.append(self.ask())
                outcome = self.attempt(queue.popleft())
                if outcome in (Outcome.FULL, Outcome.LOST):
                    continue
                if outcome is Outcome.REPEAT:
                    result.repeats += 1
                    state.repeats += 1
                    state.consecutive += 1
                    continue
                state.consecutive = 0
                if outcome is not Outcome.PRUNED and bar is not None:
                    bar.update(1)
                if bar is not None:
                    top = self.db.top_trials(self.name, 1)
                    shown = (
                        f"best {top[0]['tflops']:.0f} TFLOP/s" if top else "no feasible config yet"
                    )
                    bar.set_postfix_str(f"{shown}, pruned {result.pruned}")
        finally:
            try:
                for candidate in queue:  # asked but never measured: nothing to learn from them
                    self.shared.fail_unmeasured(candidate.trial.number)
                    self.hand_on(candidate.trial.number)
                    if not candidate.reasons and self.backend.lookahead:
                        self.backend.discard(self.problem, candidate.config)
                self.settle_in_hand()
                if bar is not None:
                    bar.close()
            finally:
                state.spent = state.elapsed()
                self.record_seconds(state.spent)

    def record_seconds(self, seconds: float) -> None:
        """Store how long this worker has searched the study (for a resume's time budget). On the
        way out of an interrupted search a failure here is reported, not raised over the
        interrupt."""
        try:
            self.db.record_study_seconds(self.run.run_id, self.name, seconds)
        except Exception as exc:  # noqa: BLE001 - the search's own exception, if any, matters more
            self.loop.say(f"fa4tune: could not record the search time of {self.name}: {exc}")

    def stop_reason(self, result: ProblemResult, size: int | None) -> str:
        """Why the problem's search stops now; empty while it goes on."""
        budget_trials, budget_seconds = self.run.budget_trials, self.run.budget_seconds
        if budget_trials is not None and result.measured >= budget_trials:
            return f"trial budget ({budget_trials}) reached"
        if budget_seconds is not None and self.state.elapsed() >= budget_seconds:
            return f"time budget ({budget_seconds:g} s) reached"
        if size is not None and result.measured + result.pruned >= size:
            return f"space exhausted (all {size} configs tried)"
        if result.pruned >= self.job.budget.pruned_cap:
            return (
                f"{result.pruned} infeasible suggestions; the space is mostly infeasible for "
                "this problem"
            )
        if self.state.consecutive >= MAX_CONSECUTIVE_REPEATS and self.job.sampler.name != "grid":
            return "converged (the sampler only proposes configs already tried)"
        return ""

    # ---- one candidate --------------------------------------------------------------------------
    def ask(self) -> Candidate:
        """Ask Optuna for the next config, marked as this worker's, and check it; a feasible new
        one is handed to the backend to prepare (compile) while earlier candidates are measured."""
        import optuna

        study, problem = self.study, self.problem
        while True:
            trial = None
            try:
                # Ctrl-C waits until the trial is in hand with its heartbeat and its worker's name:
                # from there on search's way out settles it; before, nothing could (it would stay
                # RUNNING). Any other exception goes the same way.
                with interrupts.critical():
                    with warnings.catch_warnings():
                        # "Heartbeat of storage is supposed to be used with Study.optimize."
                        warnings.simplefilter("ignore")
                        trial = study.ask()
                    self.in_hand[trial.number] = None
                    # The heartbeat first: a trial with a worker's name always has one, so that if
                    # the worker dies now, the trial either goes stale or, unnamed, is handed back
                    # at once.
                    self.in_hand[trial.number] = Heartbeat(
                        self.loop.storage, self.study_id, trial.number
                    ).start()
                    trial.set_user_attr(WORKER_ATTR, self.loop.worker)
                params = self.space.suggest(trial, problem, self.target)
            except optuna.exceptions.UpdateFinishedTrialError:
                # Unnamed, it was taken for a dead search's and handed back
                # (studies.trial_orphaned): not ours to settle; ask again.
                if trial is not None:
                    self.hand_on(trial.number)
                continue
            break
        config = self.space.full_config(problem, self.target, params)
        reasons = self.space.check(problem, config, self.target)
        heartbeat = self.in_hand[trial.number]
        candidate = Candidate(
            trial, config, trial.user_attrs.get(SOURCE_ATTR, "sampler"), reasons, heartbeat
        )
        if (
            not reasons
            and self.backend.lookahead
            and self.db.trial_by_config(self.name, config) is None
        ):
            self.backend.prefetch(problem, config)
        return candidate

    def attempt(self, candidate: Candidate) -> Outcome:
        """Claim, measure and store one candidate, and tell Optuna."""
        trial, config = candidate.trial, candidate.config
        told = False
        try:
            claim = self.shared.claim(candidate)
            if claim is not Claim.CLAIMED:
                told = True
                return Outcome(claim.value)
            measurement = self.measure(trial, config)
            try:
                self.recorder.add(
                    self.db,
                    trial.number,
                    candidate,
                    measurement,
                    study_name=self.name,
                    offer_best=not self.backend.confirms_best,
                )
            except DuplicateTrial:
                # This worker was taken for dead and its trial handed back, and the config was
                # stored by another worker meanwhile: the stored one stands.
                tell_stored(self.study, trial.number, self.db.trial_by_config(self.name, config))
                told = True
                return Outcome.REPEAT
            tell_outcome(self.study, trial.number, measurement.status, measurement.time_ms)
            told = True
            return Outcome.STOPPED if measurement.status == "stopped" else Outcome.MEASURED
        finally:
            if not told:  # interrupted or crashed before Optuna heard of the trial
                candidate.heartbeat.join()
                self.shared.settle(trial.number)
            self.hand_on(trial.number)

    def hand_on(self, number: int) -> None:
        """Trial `number` is no longer this pass's to settle: told, given back, or taken away."""
        heartbeat = self.in_hand.pop(number, None)
        if heartbeat is not None:
            heartbeat.join()

    def settle_in_hand(self) -> None:
        """Settle the trials still in hand (see __init__) that are RUNNING as this worker's, or
        unnamed (asked, and the name not yet given); not those given back or taken since."""
        import optuna

        storage = self.loop.storage
        for number in list(self.in_hand):
            self.hand_on(number)
            frozen = storage.get_trial(
                storage.get_trial_id_from_study_id_trial_number(self.study_id, number)
            )
            running = frozen.state == optuna.trial.TrialState.RUNNING
            if running and frozen.user_attrs.get(WORKER_ATTR) in (None, self.loop.worker):
                self.shared.settle(number)

    def measure(self, trial, config: dict) -> Measurement:
        options = {}
        if self.backend.multi_fidelity:
            study = self.study

            def should_stop(cheap_ms: float) -> str | None:
                trial.report(cheap_ms, step=0)
                return study.pruner.explain(study, cheap_ms) if trial.should_prune() else None

            options["should_stop"] = should_stop
        try:
            return self.backend.measure(self.problem, config, **options)
        except BackendUnavailable:
            raise  # nothing more can be measured: stop the search, keep what is stored
        except Exception as exc:  # a backend failure is the candidate's, not the search's
            return Measurement(status="failed", reason=f"{type(exc).__name__}: {exc}")

    def confirm(self) -> None:
        """Time the best few again, side by side, and store the fastest as the best config."""
        problem, kernel, name = self.problem, self.job.kernel, self.name
        top = self.db.top_trials(name, self.backend.confirm_count)
        if not top:
            return
        # The default is timed with them (when it ran correctly): a config replaces it only when it
        # is faster by more than the backend's min_gain, and in each of the same interleaved rounds.
        default = self.db.trial_by_config(name, self.space.default_config(problem, self.target))
        if (
            default is not None
            and default["status"] == "ok"
            and all(t["id"] != default["id"] for t in top)
        ):
            top.append(default)
        measurements = self.backend.confirm(problem, [kernel.config(t["config"]) for t in top])
        clocks = next(
            (m.details.get("clocks") for m in measurements if m.details.get("clocks")), None
        )
        if clocks:
            self.db.add_clocks(self.run.run_id, clocks)
        confirmed = {
            "candidates": len(top),
            "rounds": measurements[0].details.get("confirm_rounds"),
            "clocks": clocks,
        }
        self.db.confirm_best(
            run_id=self.run.run_id,
            study_name=name,
            kernel=kernel.name,
            kernel_hash=self.run.kernel_hash,
            target=self.target.name,
            problem=problem,
            confirmed=list(zip(top, measurements)),
            prefer=default["id"] if default is not None else None,
            min_gain=self.backend.min_gain,
            provenance={**self.loop.provenance, "confirmed": confirmed},
        )


def _progress_bar(problem: Problem, total: int | None, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        desc=problem.key(),
        unit="trial",
        leave=True,
        dynamic_ncols=True,
    )
