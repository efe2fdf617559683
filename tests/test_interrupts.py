"""Signals during a critical section of the search are raised when it ends, never inside it."""

import os
import signal

import pytest

from fa4tune import interrupts


def test_a_signal_inside_a_critical_section_is_raised_when_it_ends():
    reached_the_end = False
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
    assert signal.getsignal(signal.SIGTERM) is not interrupts.handler  # the previous handlers are back
