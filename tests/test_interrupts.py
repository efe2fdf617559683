"""Signals during a critical section of the search are raised when it ends, never inside it."""

import os
import signal
from datetime import datetime

import pytest
from conftest import study_states, write_job

from fa4tune import interrupts
from fa4tune.db import ResultsDB
from fa4tune.tune.job import load_job
from fa4tune.tune.search import SearchInterrupted, run_search


def test_a_signal_inside_a_critical_section_is_raised_when_it_ends():
    reached_the_end = False
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with interrupts.installed():
        with pytest.raises(KeyboardInterrupt):
            with interrupts.critical():
                os.kill(os.getpid(), signal.SIGTERM)  # delivered at once: the handler only notes it
                with interrupts.critical():  # nested: still deferred when the inner one ends
                    pass
                reached_the_end = True
        assert reached_the_end
        with pytest.raises(KeyboardInterrupt):  # outside a section: at once
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(1000):
                pass
        with interrupts.critical():  # nothing pending is left over from before
            pass
    assert (
        signal.getsignal(signal.SIGINT),
        signal.getsignal(signal.SIGTERM),
    ) == before  # the previous ones


def test_a_results_db_transaction_is_never_cut_by_a_signal(tmp_path):
    from fa4tune.db.models import Lock

    db = ResultsDB.open(str(tmp_path / "r.db"))

    def work(session):
        session.add(Lock(name="written", updated_at=datetime.now()))
        os.kill(os.getpid(), signal.SIGINT)  # mid-transaction: noted, raised after the commit
        session.add(Lock(name="also written", updated_at=datetime.now()))

    with interrupts.installed():
        with pytest.raises(KeyboardInterrupt):
            db._transact(work)
        with pytest.raises(KeyboardInterrupt):
            with db.locked("study") as lock:
                os.kill(os.getpid(), signal.SIGINT)
                lock.set_confirming("me")  # still inside the held lock: done, then the interrupt
    # Everything was committed and no lock is left held: the next writes go through at once.
    with db.locked("study") as lock:
        assert lock.confirming() == "me"
    with db._sessions() as session:
        assert (
            session.get(Lock, "written") is not None
            and session.get(Lock, "also written") is not None
        )
    db.close()


class _SignalsWhenCollected:
    """Sends this process `sig` from `__del__` and runs on until Python has run the handler there,
    where the KeyboardInterrupt it raises is printed as "Exception ignored" and dropped."""

    def __init__(self, sig, seen):
        self.sig, self.seen = sig, seen

    def __del__(self):
        try:
            os.kill(os.getpid(), self.sig)
            for _ in range(100000):
                pass
        finally:
            self.seen.append(interrupts._received)


def _signal_inside_del(sig) -> None:
    seen = []
    victim = _SignalsWhenCollected(sig, seen)
    del victim  # __del__ runs here; its KeyboardInterrupt never reaches this frame
    assert seen == [True], "the handler did not run inside __del__"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_signal_swallowed_by_a_finalizer_is_raised_at_the_next_checkpoint():
    with interrupts.installed():
        interrupts.checkpoint()  # nothing arrived yet: goes on
        _signal_inside_del(signal.SIGTERM)
        with interrupts.critical():
            interrupts.checkpoint()  # never inside a critical section
        with pytest.raises(KeyboardInterrupt):
            interrupts.checkpoint()
        with pytest.raises(KeyboardInterrupt):  # until the search ends
            interrupts.checkpoint()
    interrupts.checkpoint()  # the next search starts afresh
    with interrupts.installed():
        interrupts.checkpoint()


def signal_at_measurement(monkeypatch, number: int, send) -> list:
    """The cost model's measure, calling `send()` at its `number`-th call; the list of calls."""
    from fa4tune.measure.model import CostModelBackend

    measure, calls = CostModelBackend.measure, []

    def measure_and_signal(self, problem, config):
        calls.append(1)
        if len(calls) == number:
            send()
        return measure(self, problem, config)

    monkeypatch.setattr(CostModelBackend, "measure", measure_and_signal)
    return calls


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_search_stops_when_the_garbage_collector_swallowed_its_ctrl_c(workdir, monkeypatch):
    """What made a CI run fail: SIGTERM landed in a weakref callback and the search ran to its
    budget."""
    calls = signal_at_measurement(monkeypatch, 3, lambda: _signal_inside_del(signal.SIGINT))
    job = load_job(
        write_job(
            workdir,
            spaces={"tiles": {}, "pipeline": {}, "exp2": {}},
            budget={"trials": 50},
            sampler="random",
        )
    )
    with interrupts.installed():
        with pytest.raises(SearchInterrupted):
            run_search(job, say=lambda *a: None)
    assert len(calls) <= 4, "the search went on after the signal"
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        assert db.runs()[0]["status"] == "interrupted"
        assert 2 <= db.count_trials(db.trials()[0]["study_name"], measured_only=False) <= 4


def test_a_signal_that_stopped_one_search_does_not_stop_the_next(workdir, monkeypatch):
    signal_at_measurement(monkeypatch, 2, lambda: os.kill(os.getpid(), signal.SIGINT))
    job = load_job(write_job(workdir, budget={"trials": 6}, sampler="random"))
    with interrupts.installed():
        with pytest.raises(SearchInterrupted):
            run_search(job, say=lambda *a: None)
        summary = run_search(job, resume=True, say=lambda *a: None)  # same process, same handlers
    assert summary.resumed
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        assert db.runs()[0]["status"] == "finished"
        assert sum(t["status"] != "pruned" for t in db.trials()) == 6


def _interrupt_at_call(monkeypatch, owner, name: str, number: int) -> None:
    """KeyboardInterrupt, as the signal handler raises it, at the `number`-th call of
    owner.name, before the call does anything."""
    original, calls = getattr(owner, name), []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == number:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, interrupted)


@pytest.mark.parametrize(
    "where",
    [
        "Candidate",  # asked, heartbeat and name given, checked: the candidate is being made
        "attempt",  # taken off the queue, not yet claimed
    ],
)
def test_an_interrupt_between_asking_and_measuring_leaves_no_trial_running(
    workdir, monkeypatch, where
):
    """What made test_sigterm_is_an_interrupt_too fail now and then: a signal that landed after
    the trial was asked for (outside ask's critical section) and before the candidate was queued or
    claimed left its Optuna trial RUNNING, with nobody left to settle it."""
    from fa4tune.tune import problem_search

    owner = problem_search if where == "Candidate" else problem_search.ProblemSearch
    _interrupt_at_call(monkeypatch, owner, where, 5)
    job = load_job(
        write_job(
            workdir,
            spaces={"tiles": {}, "pipeline": {}},
            budget={"trials": 40},
            sampler="random",
        )
    )
    with interrupts.installed():
        with pytest.raises(SearchInterrupted):
            run_search(job, say=lambda *a: None)
    import optuna

    _, states = study_states(job)
    assert optuna.trial.TrialState.RUNNING not in states
    with ResultsDB.open("fa4tune-results/results.db", create=False) as db:
        assert db.runs()[0]["status"] == "interrupted"
