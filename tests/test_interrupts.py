"""Signals during a critical section of the search are raised when it ends, never inside it."""

import os
import signal
from datetime import datetime

import pytest

from fa4tune import interrupts


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
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before  # the previous ones


def test_a_results_db_transaction_is_never_cut_by_a_signal(tmp_path):
    from fa4tune.db import ResultsDB
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
        assert session.get(Lock, "written") is not None and session.get(Lock, "also written") is not None
    db.close()
