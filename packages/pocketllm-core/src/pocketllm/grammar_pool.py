"""The threads that compile grammars: a few, each with a stack large enough for any grammar the bounds admit, and a
bounded queue, apart from every other thread.

llguidance compiles by recursion, and a thread's default stack (8 MiB, or less under some libcs and container
limits) is not a bound one can rely on: an overflow kills the process. So compiles run only on these threads,
created with ``threading.stack_size`` set to GRAMMAR_COMPILE_STACK_BYTES (set only while they are created, under a
lock, and restored at once). Nothing else runs here, so a slow compile holds up only other compiles.

A compile cannot be interrupted (llguidance offers no way). When every request waiting for one has given up (its
time limit passed, or its client left), the compile is *abandoned*: dropped from the queue if it has not started;
if it has, it runs to its end on its thread, and its result is dropped. So that abandoned compiles do not keep
the pool from new ones, a spare thread is started for each running one, up to ``workers`` spares: beyond that the
pool serves fewer compiles until they end, and llguidance's own limits (grammar size, lexer fuel and states) bound
how long that is.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pocketllm.errors import OverloadedError

_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide: one pool at a time changes it


class Job:
    """One compile, shared by every request that waits for the same spec."""

    __slots__ = ("abandoned", "compile", "future", "key", "started_at", "submitted_at", "waiters")

    def __init__(self, key: str, compile: Callable[[], Any]) -> None:
        self.key, self.compile = key, compile
        self.future: Future[Any] = Future()
        self.submitted_at = time.monotonic()
        self.started_at: float | None = None
        self.waiters = 1
        self.abandoned = False

    def remaining(self, limit_s: float) -> float:
        """Seconds left before its waiters stop waiting: ``limit_s`` from its start, or from its submission while
        it is queued."""
        since = self.submitted_at if self.started_at is None else self.started_at
        return since + limit_s - time.monotonic()


class CompilePool:
    """Runs compiles on ``workers`` threads of ``stack_bytes`` (started as needed), with at most ``max_queued``
    distinct compiles waiting for a thread."""

    def __init__(self, workers: int, max_queued: int, stack_bytes: int, name: str = "pocketllm-grammar") -> None:
        self._workers, self._max_queued, self._stack_bytes, self._name = workers, max_queued, stack_bytes, name
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()
        self._jobs: dict[str, Job] = {}  # queued or running, by key
        self._threads = self._idle = self._abandoned_running = self._started = 0
        self._closed = False

    def submit(self, key: str, compile: Callable[[], Any]) -> Job:
        """The compile of ``key`` (joined if one is queued or running); OverloadedError when ``max_queued``
        compiles already wait. Each call must be matched by :meth:`release`."""
        with self._cond:
            if self._closed:
                raise OverloadedError("the engine is shutting down: no grammar compiles")
            job = self._jobs.get(key)
            if job is not None and not job.abandoned:
                job.waiters += 1
                return job
            if len(self._queue) >= self._max_queued:
                raise OverloadedError(f"{len(self._queue)} grammar compiles are waiting for a thread (the most "
                                      "queued at once): retry later")
            job = Job(key, compile)
            self._jobs[key] = job
            self._queue.append(job)
            self._spawn()
            self._cond.notify()
        return job

    def release(self, job: Job) -> None:
        """A waiter of ``job`` is done with it (it has its result, or gave up); the last one to give up before
        the result abandons the compile."""
        with self._cond:
            job.waiters -= 1
            if job.waiters > 0 or job.future.done() or job.abandoned:
                return
            job.abandoned = True
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            if job.started_at is None:
                self._queue.remove(job)
                job.future.cancel()
            else:
                self._abandoned_running += 1
                self._spawn()

    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def shutdown(self) -> None:
        """Let the threads end once idle; queued compiles still run."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _capacity(self) -> int:
        """Threads the pool may have: its workers, and a spare for each abandoned compile still running."""
        return self._workers + min(self._abandoned_running, self._workers)

    def _spawn(self) -> None:
        """Start a thread if compiles wait, none is idle, and the capacity allows (``_cond`` held)."""
        if not self._queue or self._idle > 0 or self._threads >= self._capacity():
            return
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(self._stack_bytes)
            try:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{self._started}", daemon=True)
                thread.start()
            finally:
                threading.stack_size(previous)
        self._threads += 1
        self._started += 1

    def _work(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                while not self._queue and not self._closed and self._threads <= self._capacity():
                    self._cond.wait()
                self._idle -= 1
                if not self._queue or self._threads > self._capacity():  # shut down, or a spare no longer needed
                    self._threads -= 1
                    return
                job = self._queue.popleft()
                job.started_at = time.monotonic()
            if job.future.set_running_or_notify_cancel():
                try:
                    job.future.set_result(job.compile())
                except BaseException as e:  # handed to whoever waits for it, like an executor's
                    job.future.set_exception(e)
            with self._cond:
                if self._jobs.get(job.key) is job:
                    del self._jobs[job.key]
                if job.abandoned:
                    self._abandoned_running -= 1
                    self._cond.notify_all()  # a spare idle thread may end now
