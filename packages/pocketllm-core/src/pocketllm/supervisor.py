"""The local tensor-parallel supervisor: starts N ranks of a command on this machine and owns their lifecycle.

It is not a scheduler: rank 0 schedules, and the ranks talk through the backend's collectives. The supervisor
only creates the run's rendezvous (a free loopback port, a private directory for readiness markers), starts
each rank with torchrun's variables, waits until every rank has flushed its marker, forwards SIGINT/SIGTERM,
and makes any rank's failure the group's: the others are stopped at once and the supervisor exits non-zero,
naming the rank and its last log lines. Every rank dies with the supervisor (it watches a pipe only the
supervisor holds open), so no exit path, its own SIGKILL included, leaves an orphan.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from pocketllm.tensor_parallel import READY_DIR_ENV, ParentPipe, free_port, rank_environment

LOG_LINES = 20  # of a failed rank's output, in the supervisor's error
STOP_GRACE_S = 10.0  # after forwarding SIGTERM, before SIGKILL
FAILURE_GRACE_S = 2.0  # after a rank fails, for the others to exit on SIGTERM before SIGKILL
POLL_S = 0.05


class _Rank:
    def __init__(self, rank: int, command: Sequence[str], env: dict[str, str], parent: ParentPipe) -> None:
        self.rank = rank
        self.lines: collections.deque[str] = collections.deque(maxlen=LOG_LINES)
        self.proc = subprocess.Popen(list(command), env=env | parent.environment(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, pass_fds=(parent.read_fd,))
        assert self.proc.stdout is not None
        self._pump = threading.Thread(target=self._forward, args=(self.proc.stdout,), daemon=True)
        self._pump.start()

    def _forward(self, stream: IO[bytes]) -> None:
        for raw in stream:
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            # A closed stderr (`... | head`) must not stop the draining: a rank blocked on a full pipe would
            # stall every rank's collectives.
            with contextlib.suppress(OSError, ValueError):
                print(f"[rank {self.rank}] {line}", file=sys.stderr, flush=True)

    def tail(self) -> str:
        self._pump.join(timeout=1.0)
        return "\n".join(f"  {line}" for line in self.lines) or "  (no output)"


def supervise(command: Sequence[str], world_size: int, ready_timeout_s: float) -> int:
    """Run ``command`` as ranks 0..world_size-1 until rank 0 exits; the exit status of the group."""
    stopping = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stopping.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    with tempfile.TemporaryDirectory(prefix="pocketllm-tp-") as ready_dir:
        port = free_port()
        parent = ParentPipe()
        ranks = [_Rank(r, command, os.environ | rank_environment(r, world_size, port) | {READY_DIR_ENV: ready_dir},
                       parent) for r in range(world_size)]
        try:
            return _watch(ranks, Path(ready_dir), ready_timeout_s, stopping)
        finally:
            _stop(ranks, STOP_GRACE_S)
            parent.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _watch(ranks: list[_Rank], ready_dir: Path, ready_timeout_s: float, stopping: threading.Event) -> int:
    started = time.monotonic()
    ready = False
    while True:
        if stopping.is_set():
            _signal_all(ranks, signal.SIGTERM)
            return _wait_clean_exit(ranks)
        for r in ranks:
            code = r.proc.poll()
            if code is None:
                continue
            if r.rank == 0 and code == 0:  # a clean shutdown of rank 0 ends the worker loops
                return _wait_clean_exit(ranks)
            _signal_all(ranks, signal.SIGTERM)
            _stop(ranks, FAILURE_GRACE_S)
            print(f"pocketllm: tensor-parallel rank {r.rank} of {len(ranks)} {_describe(code)}; the group is "
                  f"stopped. Its last lines:\n{r.tail()}", file=sys.stderr, flush=True)
            return 1
        if not ready:
            missing = [r.rank for r in ranks if not (ready_dir / f"rank-{r.rank}.ready").exists()]
            ready = not missing
            if ready:
                print(f"pocketllm: all {len(ranks)} tensor-parallel ranks are ready", file=sys.stderr, flush=True)
            elif time.monotonic() - started > ready_timeout_s:
                _signal_all(ranks, signal.SIGTERM)
                _stop(ranks, FAILURE_GRACE_S)
                print(f"pocketllm: tensor-parallel rank(s) {', '.join(map(str, missing))} not ready after "
                      f"{ready_timeout_s:g} s (--tensor-parallel-ready-timeout); the group is stopped. Last lines "
                      f"of rank {missing[0]}:\n{ranks[missing[0]].tail()}", file=sys.stderr, flush=True)
                return 1
        time.sleep(POLL_S)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _signal_all(ranks: list[_Rank], sig: signal.Signals) -> None:
    for r in ranks:
        if r.proc.poll() is None:
            r.proc.send_signal(sig)


def _wait_clean_exit(ranks: list[_Rank]) -> int:
    deadline = time.monotonic() + STOP_GRACE_S
    for r in ranks:
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.proc.wait(max(0.0, deadline - time.monotonic()))
    codes = [r.proc.poll() for r in ranks]
    return 0 if all(code == 0 for code in codes) else 1


def _stop(ranks: list[_Rank], grace_s: float) -> None:
    """Every rank gone: those still running after ``grace_s`` are killed; all are reaped."""
    deadline = time.monotonic() + grace_s
    for r in ranks:
        try:
            r.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait()
