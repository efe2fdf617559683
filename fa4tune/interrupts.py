"""Ctrl-C and SIGTERM that never land inside a critical section of the search.

A search stops by KeyboardInterrupt, raised by the signal handler wherever the main thread happens
to be. Between Optuna creating a trial (`study.ask`) and the search naming it as its own there is no
`finally` that could settle the trial: an interrupt there would leave it RUNNING until a later
search finds its heartbeat stale. A write transaction of the results DB is another: interrupted
between its BEGIN and the session's close, it kept SQLite's write lock, and the search's own last
write (the run marked interrupted) then waited for it forever. `critical()` marks such a section: a
signal that arrives inside it is raised as KeyboardInterrupt when the section ends (at the next
statement that can settle the trial). `handler` is the signal handler that knows about it;
`installed()` puts it in place for SIGINT and SIGTERM while a search runs (main thread only;
elsewhere signals are not this module's business).

Python runs a signal handler wherever the main thread is, a weakref callback or a `__del__` run by
the garbage collector included, and there an exception is printed ("Exception ignored in ...") and
dropped: the KeyboardInterrupt is lost and the search went on to its budget. So a signal is also
remembered until the next search begins (`forget`), and the search's loops call `checkpoint()`,
which raises it again."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager

_depth = 0
_pending = False
# A signal arrived since the search began (see `forget`; a worker process: its whole life).
_received = False


def handler(signum=None, frame=None) -> None:
    """KeyboardInterrupt now, or at the end of the critical section the main thread is in."""
    global _pending, _received
    _received = True
    if _depth:
        _pending = True
        return
    raise KeyboardInterrupt


@contextmanager
def critical():
    """A section no signal interrupts; one that arrived meanwhile is raised when it ends. Signals
    are handled by the main thread only, so in any other thread this does nothing."""
    global _depth, _pending
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _pending:
            _pending = False
            raise KeyboardInterrupt


def forget() -> None:
    """A new search begins: signals that stopped an earlier one in this process do not stop it."""
    global _received
    _received = False


def checkpoint() -> None:
    """KeyboardInterrupt if a signal arrived whose KeyboardInterrupt was swallowed on the way (see
    the module's docstring); call it where a loop of the search may stop. Outside a critical section
    only."""
    if _received and not _depth and threading.current_thread() is threading.main_thread():
        raise KeyboardInterrupt


@contextmanager
def installed(signals=(signal.SIGINT, signal.SIGTERM)):
    """`handler` for these signals while the block runs (in the main thread; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    forget()
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        forget()
