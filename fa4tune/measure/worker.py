"""Persistent worker processes: candidate work that may crash or hang runs in a child process, never
in the search's own.

A worker is started with the `spawn` context (a forked child would inherit the parent's CUDA and
thread state), imports a *worker module* and keeps whatever that module puts in its `state` dict
(compiled kernels, inputs) from one request to the next. The module provides

    describe(state) -> dict                      once, at start-up (the device it owns, versions)
    <op>(request, channel, state) -> dict        one per request, named by request["op"]

and reports progress through the `channel`: `channel.phase("run")` when the compile is done and the
device work starts (the parent switches from the compile timeout to the run timeout), and
`channel.ask(payload)` for a decision only the parent can make (the pruner's verdict).

The parent never blocks on a dead or hung child: every wait has a deadline, a missed deadline kills
the child (SIGKILL), and end-of-file on the pipe is a death whose exit code or signal becomes the
reason. An exception raised after the `run` phase began ends the child too (a CUDA error leaves its
context unusable); the next request starts a fresh one. A child whose parent dies exits by
itself."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

FIRST_PHASE = "compile"
RUN_PHASE = "run"
EXIT_AFTER_DEVICE_ERROR = 70  # the child leaves after an exception in the run phase


class WorkerUnavailable(RuntimeError):
    """The worker could not be started (import error, no device, start-up timed out)."""


@dataclass
class Reply:
    """The outcome of one request: `result` when the worker finished it, else `reason` (an
    exception in the worker, its death, or a timeout). `restarted` says the worker is gone and the
    next request starts a new one. `unserved` says the request never reached a working worker (none
    could be started, or the pool stopped): the failure is not the request's."""

    ok: bool
    result: dict | None = None
    reason: str | None = None
    phase: str = FIRST_PHASE
    seconds: float = 0.0
    restarted: bool = False
    phase_seconds: dict = field(default_factory=dict)
    unserved: bool = False


def describe_exit(exitcode: int | None) -> str:
    """'killed by SIGSEGV', 'exit status 3'."""
    if exitcode is None:
        return "no exit status"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    if exitcode == EXIT_AFTER_DEVICE_ERROR:
        return "ended after a device error"
    return f"exit status {exitcode}"


class WorkerProcess:
    """One child process and the conversation with it. Not thread-safe: one caller at a time."""

    def __init__(
        self,
        module: str,
        *,
        env: dict | None = None,
        start_timeout: float = 300.0,
        name: str = "fa4tune-worker",
    ) -> None:
        self.module = module
        self.env = dict(env or {})
        self.start_timeout = start_timeout
        self.name = name
        self.info: dict | None = None  # what describe() returned
        self.starts = 0
        self._process = None
        self._conn: Connection | None = None
        self._pending: dict | None = None  # the request in flight: phase, deadlines, timing
        self._launched = 0.0

    # ---- life cycle ---------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    @property
    def busy(self) -> bool:
        return self._pending is not None

    @property
    def connection(self) -> Connection | None:
        return self._conn

    def launch(self) -> None:
        """Spawn the child without waiting for it (several can then start side by side)."""
        if self._process is not None and self._process.is_alive():
            return
        self.kill()
        context = multiprocessing.get_context("spawn")
        parent_end, child_end = context.Pipe(duplex=True)
        process = context.Process(
            target=_worker_main,
            args=(child_end, self.module, self.env),
            name=self.name,
            daemon=True,
        )
        process.start()
        child_end.close()
        self._process, self._conn = process, parent_end
        self._launched = time.monotonic()
        self.starts += 1

    def start(self) -> dict:
        """Start the child (if not running) and wait for its description; WorkerUnavailable when it
        cannot start."""
        if self.alive and self.info is not None:
            return self.info
        self.launch()
        try:
            message = self._receive(self._launched + self.start_timeout)
        except _Gone as gone:
            self.kill()
            raise WorkerUnavailable(
                f"the worker ({self.module}) did not start: {gone.reason}"
            ) from None
        if message[0] != "ready":
            self.kill()
            raise WorkerUnavailable(f"the worker ({self.module}) did not start: {message[1]}")
        self.info = message[1]
        return self.info

    def kill(self) -> None:
        """End the child at once (SIGKILL) and forget any request in flight."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        self._pending = None
        self.info = None
        if process is not None:
            if process.is_alive():
                process.kill()
            process.join(timeout=10)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        """Ask the child to stop, then make sure it has."""
        if self.alive and self._conn is not None and self._pending is None:
            try:
                self._conn.send({"op": "stop"})
                self._process.join(timeout=5)
            except (OSError, EOFError):
                pass
        self.kill()

    # ---- one request --------------------------------------------------------------------------
    def submit(self, request: dict, timeouts: dict[str, float]) -> None:
        """Send a request; `timeouts` maps each phase (compile, run) to its seconds."""
        self.start()
        now = time.monotonic()
        self._pending = {
            "timeouts": dict(timeouts),
            "phase": FIRST_PHASE,
            "started": now,
            "phase_started": now,
            "phase_seconds": {},
        }
        self._pending["deadline"] = now + self._pending["timeouts"].get(FIRST_PHASE, float("inf"))
        try:
            self._conn.send(request)
        except (OSError, EOFError, BrokenPipeError):
            pass  # the child is gone: the next step reports how it ended

    def step(self, wait_s: float | None, on_ask=None) -> Reply | None:
        """Advance the request in flight by at most one message: the final Reply, or None when it
        is still running after `wait_s` seconds (None: until its phase's deadline)."""
        pending = self._pending
        assert pending is not None, "no request in flight"
        limit = (
            pending["deadline"]
            if wait_s is None
            else min(pending["deadline"], time.monotonic() + wait_s)
        )
        try:
            message = self._receive(limit)
        except _Gone as gone:
            if gone.timed_out and time.monotonic() < pending["deadline"]:
                return None  # only our own wait ran out
            reason = (
                f"{pending['phase']} timed out after {pending['timeouts'][pending['phase']]:g} s"
                if gone.timed_out
                else f"the worker died during {pending['phase']} ({gone.reason})"
            )
            return self._finish(Reply(ok=False, reason=reason), restart=True)
        kind = message[0]
        if kind == "phase":
            now = time.monotonic()
            pending["phase_seconds"][pending["phase"]] = now - pending["phase_started"]
            pending["phase"], pending["phase_started"] = message[1], now
            pending["deadline"] = now + pending["timeouts"].get(message[1], float("inf"))
            return None
        if kind == "ask":
            try:
                answer = on_ask(message[1]) if on_ask is not None else None
            except BaseException:
                # Interrupted while the child waits for the answer: it cannot be left mid-request.
                self.kill()
                raise
            try:
                self._conn.send(("answer", answer))
            except (OSError, EOFError, BrokenPipeError):
                pass
            return None
        if kind == "done":
            return self._finish(Reply(ok=True, result=message[1]), restart=False)
        if kind == "error":
            _, text, device_touched = message
            return self._finish(Reply(ok=False, reason=text), restart=device_touched)
        return self._finish(
            Reply(ok=False, reason=f"unexpected message from the worker: {message!r}"), restart=True
        )

    def request(self, request: dict, timeouts: dict[str, float], on_ask=None) -> Reply:
        """Send a request and wait for its outcome (bounded by the phase timeouts)."""
        self.submit(request, timeouts)
        while True:
            reply = self.step(None, on_ask)
            if reply is not None:
                return reply

    def _finish(self, reply: Reply, restart: bool) -> Reply:
        pending = self._pending
        now = time.monotonic()
        pending["phase_seconds"][pending["phase"]] = now - pending["phase_started"]
        reply.phase, reply.seconds = pending["phase"], now - pending["started"]
        reply.phase_seconds = pending["phase_seconds"]
        self._pending = None
        if restart:
            self.kill()
            reply.restarted = True
        return reply

    def _receive(self, deadline: float):
        """The next message, or _Gone (timed out, or the child died)."""
        conn, process = self._conn, self._process
        if conn is None:
            raise _Gone("the worker is not running", timed_out=False)
        while True:
            remaining = deadline - time.monotonic()
            # Past the deadline, a reply already in the pipe still counts: the caller may have come
            # late (the compile pool's one thread was starting another worker meanwhile).
            if remaining <= 0 and not conn.poll(0):
                raise _Gone("timed out", timed_out=True)
            # Poll in short slices so that a child that died without closing its end is noticed.
            if conn.poll(min(max(remaining, 0.0), 0.5)):
                try:
                    return conn.recv()
                except (EOFError, OSError):
                    process.join(timeout=5)
                    raise _Gone(describe_exit(process.exitcode), timed_out=False) from None
            if not process.is_alive():
                if conn.poll(0):
                    continue  # it said something before it went
                process.join(timeout=5)
                raise _Gone(describe_exit(process.exitcode), timed_out=False)


class _Gone(Exception):
    def __init__(self, reason: str, timed_out: bool) -> None:
        super().__init__(reason)
        self.reason = reason
        self.timed_out = timed_out


# ---- the child side -----------------------------------------------------------------------------
class Channel:
    """What a worker function uses to talk to the parent during a request."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self.device_touched = False

    def phase(self, name: str) -> None:
        """Enter a phase with its own timeout. From RUN_PHASE on, an exception ends the worker."""
        if name == RUN_PHASE:
            self.device_touched = True
        self._conn.send(("phase", name))

    def ask(self, payload):
        """A decision of the parent's (it answers None when it has no opinion)."""
        self._conn.send(("ask", payload))
        message = self._conn.recv()
        return message[1]


def exit_with_parent() -> None:
    """Leave when the parent dies: a SIGKILLed search must not leave a hung worker behind."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        from multiprocessing.connection import wait

        wait([parent.sentinel])
        os._exit(0)

    threading.Thread(target=watch, name="fa4tune-parent-watch", daemon=True).start()


def _worker_main(conn: Connection, module_name: str, env: dict) -> None:
    os.environ.update(env)
    # Ctrl-C reaches the whole process group; the parent decides what stops, and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with_parent()
    state: dict = {}
    try:
        module = importlib.import_module(module_name)
        info = module.describe(state)
    except BaseException as exc:  # noqa: BLE001 - report anything, the parent decides
        conn.send(("start-failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", info))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request.get("op") == "stop":
            return
        channel = Channel(conn)
        try:
            function = getattr(module, request["op"])
            result = function(request, channel, state)
        except Exception as exc:  # noqa: BLE001
            conn.send(("error", f"{type(exc).__name__}: {exc}", channel.device_touched))
            if channel.device_touched:
                conn.close()
                os._exit(EXIT_AFTER_DEVICE_ERROR)
            continue
        conn.send(("done", result))
