"""The threads that compile grammars: a few, each with a stack large enough for any grammar the bounds admit.

llguidance compiles by recursion, and a thread's default stack (8 MiB, or less under some libcs and container
limits) is not a bound one can rely on: an overflow kills the process. So compiles run only on these threads,
created with ``threading.stack_size`` set to GRAMMAR_COMPILE_STACK_BYTES (set only while they are created, under a
lock, and restored at once).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide: one pool at a time changes it


class _Job:
    __slots__ = ("compile", "future")

    def __init__(self, compile: Callable[[], Any]) -> None:
        self.compile = compile
        self.future: Future[Any] = Future()

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            self.future.set_result(self.compile())
        except BaseException as e:  # handed to whoever waits for it, like an executor's
            self.future.set_exception(e)


class CompilePool:
    """Runs compiles on at most ``workers`` threads of ``stack_bytes`` each, started as they are needed."""

    def __init__(self, workers: int, stack_bytes: int, name: str = "pocketllm-grammar") -> None:
        self._workers, self._stack_bytes, self._name = workers, stack_bytes, name
        self._cond = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._threads = self._idle = 0
        self._closed = False

    def submit(self, compile: Callable[[], Any]) -> Future[Any]:
        job = _Job(compile)
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar compile pool is shut down")
            self._queue.append(job)
            if self._idle == 0 and self._threads < self._workers:
                self._start_thread()
            self._cond.notify()
        return job.future

    def shutdown(self) -> None:
        """Let the threads end once idle; queued compiles still run."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _start_thread(self) -> None:
        with _STACK_SIZE_LOCK:
            previous = threading.stack_size(self._stack_bytes)
            try:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{self._threads}", daemon=True)
                thread.start()
            finally:
                threading.stack_size(previous)
        self._threads += 1

    def _work(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                while not self._queue and not self._closed:
                    self._cond.wait()
                self._idle -= 1
                if not self._queue:
                    self._threads -= 1
                    return
                job = self._queue.popleft()
            job.run()
