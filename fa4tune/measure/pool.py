"""Compiling ahead: a few worker processes compile the candidates the search will measure next while
the GPU worker times the current one.

`cute.compile` never uses the CuTe DSL's on-disk cache (it forces no_cache), so a compile done in
one process cannot be picked up from that cache by another. What crosses processes is the DSL's AOT
export: the compiling process writes the kernel as an object file (`export_to_c`), and the GPU
worker loads it in milliseconds (`cute.runtime.load_module`). Object files are kept under a cache
directory keyed by kernel version and compile key, so a later run (or another problem with the same
head dims and causality) reuses them.

A background thread feeds the compile workers and collects their results, so that they keep working
while the caller waits on the GPU worker."""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

from .worker import Reply, WorkerProcess, WorkerUnavailable

POLL_SECONDS = 0.05


@dataclass
class _Job:
    message: dict
    state: str = "queued"  # queued, running, done
    reply: Reply | None = None
    started: float | None = None


class CompilePool:
    """Compile requests by key: `submit` queues one (once), `result` waits for its Reply."""

    def __init__(
        self,
        module: str,
        workers: int,
        compile_timeout: float,
        *,
        env: dict | None = None,
        start_timeout: float = 300.0,
    ) -> None:
        if workers < 1:
            raise ValueError("a compile pool needs at least one worker")
        # Compile workers never touch the GPU: hide it so that none creates a CUDA context there.
        env = {"CUDA_VISIBLE_DEVICES": "", **(env or {})}
        self.compile_timeout = compile_timeout
        self._workers = [
            WorkerProcess(module, env=env, start_timeout=start_timeout, name=f"fa4tune-compile-{i}")
            for i in range(workers)
        ]
        self._jobs: dict[str, _Job] = {}
        self._queue: deque[str] = deque()
        self._running: dict[int, str] = {}  # worker index -> job key
        self._cond = threading.Condition()
        self._closed = False
        self._error: str | None = None
        self._thread = threading.Thread(target=self._loop, name="fa4tune-compile-pool", daemon=True)
        self._thread.start()

    def submit(self, key: str, message: dict) -> None:
        with self._cond:
            if key in self._jobs or self._closed:
                return
            self._jobs[key] = _Job(message)
            self._queue.append(key)
            self._cond.notify_all()

    def submitted(self, key: str) -> bool:
        with self._cond:
            return key in self._jobs

    def result(self, key: str) -> Reply:
        """Wait for a submitted job. The compile timeout is enforced by the pool from the moment a
        worker takes the job, so this wait ends."""
        with self._cond:
            job = self._jobs[key]
            while job.state != "done" and not self._closed and self._thread.is_alive():
                self._cond.wait(timeout=1.0)
            if job.reply is None:
                return Reply(
                    ok=False,
                    reason=f"the compile pool stopped ({self._error or 'closed'})",
                    unserved=True,
                )
            return job.reply

    def discard(self, key: str) -> None:
        """Drop a job no one will wait for: taken off the queue if it has not started, forgotten if
        done; a running one finishes (its artifact is kept for whoever compiles that key next)."""
        with self._cond:
            job = self._jobs.get(key)
            if job is None or job.state == "running":
                return
            if job.state == "queued":
                self._queue.remove(key)
            del self._jobs[key]

    def forget(self, key: str) -> None:
        """Drop a finished job (its artifact stays on disk)."""
        with self._cond:
            job = self._jobs.get(key)
            if job is not None and job.state == "done":
                del self._jobs[key]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        for worker in self._workers:
            worker.kill()

    # ---- the feeding thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._feed()
        except BaseException as exc:  # a bug here must not leave result() waiting forever
            self._error = f"{type(exc).__name__}: {exc}"
            with self._cond:
                self._cond.notify_all()
            raise

    def _feed(self) -> None:
        for worker in self._workers:  # all spawn side by side; each is waited for when first used
            worker.launch()
        while True:
            with self._cond:
                if self._closed:
                    return
                assigned = self._assign()
                if not assigned and not self._running:
                    self._cond.wait(timeout=1.0)
                    continue
            for index, key, message in assigned:  # outside the lock: this may (re)start a process
                try:
                    self._workers[index].submit(message, {"compile": self.compile_timeout})
                except WorkerUnavailable as exc:
                    self._complete(index, key, Reply(ok=False, reason=str(exc), unserved=True))
            with self._cond:
                busy = dict(self._running)
            for index, key in busy.items():
                reply = self._workers[index].step(POLL_SECONDS / max(1, len(busy)))
                if reply is not None:
                    self._complete(index, key, reply)

    def _assign(self) -> list[tuple[int, str, dict]]:
        """Queued jobs for idle workers, marked running (called with the lock held)."""
        assigned = []
        for index in range(len(self._workers)):
            if not self._queue:
                break
            if index in self._running:
                continue
            key = self._queue.popleft()
            job = self._jobs[key]
            job.state, job.started = "running", time.monotonic()
            self._running[index] = key
            assigned.append((index, key, job.message))
        return assigned

    def _complete(self, index: int, key: str, reply: Reply) -> None:
        with self._cond:
            self._running.pop(index, None)
            job = self._jobs.get(key)
            if job is not None:
                job.state, job.reply = "done", reply
            self._cond.notify_all()
