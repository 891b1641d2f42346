"""The HTTP target of the serve workload: a ``pocketllm-server`` process, driven by the clients of ``serving``.

It answers ``call`` like a worker (ops ``serve`` and ``rss``), so the runner interleaves it with the library
worker whose settings it copies: model, backend, dtype, KV sizing, ``backend_options`` and thread variables.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx

from pocketbench.config import EngineSpec
from pocketbench.serving import run_clients
from pocketbench.workers import WorkerError, engine_env, tail

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def server_command(spec: EngineSpec, backend_options: dict[str, Any], port: int) -> list[str]:
    assert spec.backend is not None
    return [sys.executable, "-m", "pocketllm_server", "--host", HOST, "--port", str(port), "--model", spec.model,
            "--backend", spec.backend, "--dtype", spec.dtype, "--max-model-len", str(spec.max_len),
            "--max-num-seqs", str(spec.max_seqs), "--backend-options", json.dumps(backend_options)]


class ServerTarget:
    """``pocketllm-server`` in its own process; ``__init__`` returns once ``/ready`` answers 200."""

    def __init__(self, spec: EngineSpec, backend_options: dict[str, Any], log_dir: Path,
                 ready_timeout_s: float = 600) -> None:
        self.label = spec.label.replace("-async", "-http")
        self.log_path = log_dir / f"{self.label}.log"
        port = free_port()
        self.url = f"http://{HOST}:{port}"
        command = server_command(spec, backend_options, port)
        start = time.perf_counter()
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=engine_env(spec.threads) | {"PYTHONPATH": spec.python_path()})
        try:
            self._wait_ready(ready_timeout_s)
        except BaseException:
            self.close()
            raise
        self.info: dict[str, Any] = {
            "engine": f"pocketllm-server {version('pocketllm-server')} (hypercorn {version('hypercorn')}), "
                      f"streaming /v1/completions; clients: httpx {httpx.__version__} in the bench process",
            "flags": " ".join(command[3:]), "load_s": time.perf_counter() - start}

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=self.url, timeout=5, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise self._error(f"exited (code {self.process.returncode}) before it was ready")
                try:
                    if client.get("/ready").status_code == 200:
                        return
                except httpx.TransportError:
                    pass  # not listening yet
                time.sleep(0.2)
        raise self._error(f"not ready after {timeout_s:.0f} s")

    def call(self, op: str, **arguments: Any) -> dict[str, Any]:
        if self.process.poll() is not None:
            raise self._error(f"exited (code {self.process.returncode})")
        if op == "rss":
            return {"peak_rss_mb": self._peak_rss_mb()}
        if op != "serve":
            raise ValueError(f"op {op!r} is not the server's")
        try:
            return run_clients(self.url, arguments["prompts"], arguments["max_tokens"])
        except Exception as e:
            raise self._error(f"failed a run: {type(e).__name__}: {e}") from e

    def _peak_rss_mb(self) -> float:
        """VmHWM of the server process: the same peak as a worker's (``worker.peak_rss_mb``)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
        raise RuntimeError("no VmHWM in /proc/<pid>/status")

    def close(self) -> None:
        """Stop the server as an operator would (SIGINT: graceful shutdown), killing it if that hangs."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _error(self, what: str) -> WorkerError:
        return WorkerError(f"{self.label} server {what}; log: {self.log_path}\n{tail(self.log_path)}")
