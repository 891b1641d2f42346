"""Parent side of the worker protocol: start one process per engine and call it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from pocketbench.config import EngineSpec
from pocketbench.protocol import read_message, write_message

HARNESS_ROOT = Path(__file__).resolve().parent.parent  # the directory that holds the pocketbench package
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


class WorkerError(RuntimeError):
    pass


class Worker:
    """An engine loaded in its own process; ``call`` blocks until it answers."""

    def __init__(self, spec: EngineSpec, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.label}.log"
        env = engine_env(spec.threads)
        env["PYTHONPATH"] = spec.python_path(str(HARNESS_ROOT))
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "pocketbench.worker", json.dumps(spec.to_json())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        self.info: dict[str, Any] = self._reply()

    @property
    def label(self) -> str:
        return self.spec.label

    def call(self, op: str, **arguments: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        write_message(self.process.stdin, {"op": op, **arguments})
        return self._reply()

    def _reply(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        message = read_message(self.process.stdout)
        if message is None:
            raise WorkerError(f"{self.spec.label} worker exited (code {self.process.wait()}); "
                              f"log: {self.log_path}\n{tail(self.log_path)}")
        if not message["ok"]:
            raise WorkerError(f"{self.spec.label} worker failed; log: {self.log_path}\n{message['error']}")
        return message["result"]

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


def engine_env(threads: int) -> dict[str, str]:
    """The environment of an engine process: ours, with every thread-count variable set to ``threads``."""
    return {**os.environ, **dict.fromkeys(THREAD_VARIABLES, str(threads))}


def tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
