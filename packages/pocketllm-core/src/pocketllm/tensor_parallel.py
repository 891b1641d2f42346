"""Tensor-parallel ranks: where this process stands, what a worker rank runs, and ranks started for the library.

A tensor-parallel engine is N processes, one per rank, joined by the backend's own collectives. Each process
learns its place from the environment torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so one launch works on one machine or across several.
Rank 0 builds the engine as usual and schedules; every other rank runs its backend's worker loop
(:meth:`pocketllm.backend.BackendPlugin.run_tp_worker`) until rank 0 shuts down. The processes come from:

- the supervisor (``supervisor.py``) behind ``pocketllm-server --tensor-parallel-size N`` and ``pocketllm serve``;
- torchrun or any launcher that sets those variables (``--no-tensor-parallel-supervisor``);
- ``LLM(tensor_parallel_size=N)`` in a process without ``RANK``: :class:`LocalRanks` starts ranks 1..N-1 as
  child processes of this one, which becomes rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import msgspec

from pocketllm.args import EngineArgs
from pocketllm.backend import TensorParallelBackend
from pocketllm.errors import ConfigError, UnsupportedOptionError

READY_DIR_ENV = "POCKETLLM_TP_READY_DIR"  # where each rank flushes its readiness marker (set by the supervisor)
PARENT_PIPE_ENV = "POCKETLLM_TP_PARENT_FD"  # the inherited pipe a rank watches for its launcher's exit
_ARGS_ENV = "POCKETLLM_TP_ENGINE_ARGS"  # a library-started worker's EngineArgs, as JSON


@dataclass(frozen=True, slots=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def rank_info(environ: Mapping[str, str] | None = None) -> RankInfo | None:
    """This process's rank from torchrun's variables, or None where ``RANK`` is not set."""
    env = os.environ if environ is None else environ
    if "RANK" not in env:
        return None

    def number(key: str, default: str | None = None, low: int = 0) -> int:
        raw = env.get(key, default)
        try:
            value = int(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise ConfigError("tensor_parallel_size", f"environment variable {key}={raw!r} is not an integer") \
                from None
        if not low <= value < 1 << 31:
            raise ConfigError("tensor_parallel_size", f"environment variable {key}={value} is out of range")
        return value

    world = number("WORLD_SIZE", low=1)
    info = RankInfo(rank=number("RANK"), world_size=world, local_rank=number("LOCAL_RANK", env["RANK"]),
                    local_world_size=number("LOCAL_WORLD_SIZE", str(world), low=1),
                    master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=number("MASTER_PORT", "29500", 1))
    if info.rank >= world:
        raise ConfigError("tensor_parallel_size", f"RANK={info.rank} is not below WORLD_SIZE={world}")
    return info


def check_world(args: EngineArgs, info: RankInfo) -> None:
    if info.world_size != args.tensor_parallel_size:
        raise ConfigError("tensor_parallel_size", f"{args.tensor_parallel_size}, but this process was launched "
                                                  f"as one of WORLD_SIZE={info.world_size} ranks")


def mark_ready(rank: int) -> None:
    """Tell the supervisor (if one started this process) that this rank is ready: a flushed marker file."""
    directory = os.environ.get(READY_DIR_ENV)
    if not directory:
        return
    marker = Path(directory) / f"rank-{rank}.ready"
    partial = marker.with_suffix(".partial")
    with open(partial, "w") as f:
        f.write(str(os.getpid()))
        f.flush()
        os.fsync(f.fileno())
    partial.rename(marker)


def run_worker(args: EngineArgs, ready: Callable[[], None] | None = None) -> None:
    """Serve as a non-zero rank: load the checkpoint, pick the backend as rank 0 does, and run its worker loop
    until rank 0 shuts down. ``ready`` is called once the rank has joined its group and holds its weights."""
    from pocketllm.args import resolve_max_model_len
    from pocketllm.capability_checks import check_engine_args
    from pocketllm.checkpoint import load_checkpoint
    from pocketllm.plugins import BackendRegistry

    info = rank_info()
    if info is None or info.rank == 0:
        raise ConfigError("tensor_parallel_size", "run_worker is for ranks other than 0 (RANK is not set or 0)")
    check_world(args, info)
    checkpoint = load_checkpoint(args.model, args.model_format)
    args = dataclasses.replace(args, max_model_len=resolve_max_model_len(args, checkpoint.config))
    plugin = BackendRegistry().select(args, checkpoint)
    options = check_engine_args(plugin.name, plugin.capabilities(), args, checkpoint)
    if not isinstance(plugin, TensorParallelBackend):
        raise UnsupportedOptionError("tensor_parallel_size", plugin.name, "it declares tensor parallelism but has "
                                     "no run_tp_worker (pocketllm.backend.TensorParallelBackend)")
    if threading.current_thread() is threading.main_thread():
        # A stop signal ends rank 0's engine, whose shutdown ends this loop: the worker waits for that (or for
        # the collectives to fail, if rank 0 is gone) rather than dying under a collective in flight.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    plugin.run_tp_worker(args, checkpoint, options, ready or (lambda: mark_ready(info.rank)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ParentPipe:
    """A pipe whose read end the ranks inherit and whose write end only this process holds: a rank reads EOF
    once this process is gone, however it ended (SIGKILL included), and exits (see :func:`watch_parent`).

    A pipe rather than a parent-death signal: that signal follows the thread that forked the child, so a rank
    of an engine built on a short-lived thread would die with the thread.
    """

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe()
        os.set_inheritable(self.read_fd, True)

    def environment(self) -> dict[str, str]:
        return {PARENT_PIPE_ENV: str(self.read_fd)}

    def close(self) -> None:
        for fd in (self.read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def watch_parent() -> None:
    """In a rank a supervisor or the library started: exit the moment the launching process is gone."""
    fd = os.environ.pop(PARENT_PIPE_ENV, None)
    if fd is None or not fd.isdigit():
        return

    def watch() -> None:
        try:
            while os.read(int(fd), 1):
                pass
        finally:
            os._exit(1)

    threading.Thread(target=watch, name="pocketllm-parent-watch", daemon=True).start()


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


_abandoned = threading.Event()


def launch_abandoned() -> bool:
    """Whether the library gave up starting this process's ranks (one died first): a backend waiting for the
    others to join its group stops waiting."""
    return _abandoned.is_set()


class LocalRanks:
    """Ranks 1..N-1 on this machine, started for a library engine; this process becomes rank 0.

    Rank 0's variables go into this process's environment, where the backend reads them (as under torchrun).
    """

    active: ClassVar[bool] = False  # torch.distributed and its peers hold one group per process

    def __init__(self, args: EngineArgs) -> None:
        if LocalRanks.active:
            raise ConfigError("tensor_parallel_size", "this process already holds a tensor-parallel engine (its "
                                                      "collectives are per process): shut it down first")
        world = args.tensor_parallel_size
        port = free_port()
        self._log_dir = tempfile.TemporaryDirectory(prefix="pocketllm-tp-")
        self._parent = ParentPipe()
        ours = rank_environment(0, world, port)
        self._saved = {key: os.environ.get(key) for key in ours}
        payload = msgspec.json.encode(args).decode()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []
        LocalRanks.active = True
        _abandoned.clear()
        try:
            for rank in range(1, world):
                log = Path(self._log_dir.name) / f"rank-{rank}.log"
                env = os.environ | rank_environment(rank, world, port) | self._parent.environment() | {
                    _ARGS_ENV: payload}
                env.pop(READY_DIR_ENV, None)
                with open(log, "wb") as out:
                    self.procs.append(subprocess.Popen([sys.executable, "-m", "pocketllm.tensor_parallel"],
                                                       env=env, stdout=out, stderr=subprocess.STDOUT,
                                                       pass_fds=(self._parent.read_fd,)))
                self.logs.append(log)
        except BaseException:
            self.abandon()
            raise
        os.environ.update(ours)

    def failure(self) -> str | None:
        """Which rank exited, with its last log lines, or None while all run."""
        for rank, (proc, log) in enumerate(zip(self.procs, self.logs, strict=True), start=1):
            if proc.poll() is not None:
                tail = log.read_text(errors="replace").splitlines()[-20:]
                return f"rank {rank} exited with code {proc.returncode}; its last lines:\n" + "\n".join(tail)
        return None

    def abandon(self) -> None:
        """Give up on the group (a rank died, or rank 0 failed): kill the ranks, and stop rank 0's wait for them."""
        _abandoned.set()
        self.close(timeout=0)

    def close(self, timeout: float = 10.0) -> None:
        """Wait for the ranks (rank 0's engine shutdown ends their loops), killing any that outstay ``timeout``."""
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for key, value in self._saved.items():  # the environment as this process had it
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._parent.close()
        self._log_dir.cleanup()
        LocalRanks.active = False


def _library_worker() -> int:
    watch_parent()
    args = msgspec.json.decode(os.environ[_ARGS_ENV], type=EngineArgs)
    run_worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(_library_worker())
