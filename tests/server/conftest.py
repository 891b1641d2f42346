"""Fixtures for the server tests: engines on the tiny checkpoint, and real hypercorn servers in threads."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.applications import Starlette

from pocketllm import AsyncLLM, EngineArgs
from pocketllm.plugins import BackendRegistry
from pocketllm.testing import GatedBackend, StepGate
from pocketllm_server import create_app

MODEL_NAME = "tiny"
# A chat template in the hermes layout (Qwen2.5's, made small): it shows the tools and the assistant's calls.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for tool in tools %}{{ tool.function.name }} {% endfor %}</tools>"
    "<|im_end|>\n{% endif %}{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "{% for call in message.tool_calls or [] %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class LiveServer:
    """A hypercorn server on 127.0.0.1 (a port the OS picked), on its own event loop in a thread."""

    def __init__(self, app: Starlette) -> None:
        self.app = app
        self.loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="test-hypercorn", daemon=True)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.config = Config()
        # Handing hypercorn a socket that is already bound avoids racing other tests for a free port.
        self.config.bind = [f"fd://{sock.detach()}"]
        self.config.graceful_timeout = 2.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            self._started.set()
            await serve(self.app, self.config, shutdown_trigger=self._stop.wait)  # type: ignore[arg-type]

        try:
            self.loop.run_until_complete(main())
        except BaseException as e:
            self._error = e
        finally:
            self._started.set()
            self.loop.close()

    def call(self, coro: Any, timeout: float = 30.0) -> Any:
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> LiveServer:
        self._thread.start()
        self._started.wait(10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self._error is not None:
                raise RuntimeError("server failed to start") from self._error
            try:
                if httpx.get(f"{self.url}/alive", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.02)
        raise RuntimeError("server did not answer /alive")

    def stop(self) -> None:
        if self._stop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        assert not self._thread.is_alive(), "server did not stop"


def _wait_for(predicate: Callable[[], bool], timeout: float = 5.0, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


@pytest.fixture
def wait_for() -> Callable[..., bool]:
    """``wait_for(predicate, timeout=5.0)``: poll until true; returns the last answer."""
    return _wait_for


@pytest.fixture(scope="session")
def tiny_args(pocketllm_tiny_llama: Path) -> EngineArgs:
    return EngineArgs(model=str(pocketllm_tiny_llama), backend="echo")


@pytest.fixture(scope="session")
def tiny_with_template(pocketllm_tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tiny_with_template(template)``: a copy of the tiny checkpoint whose chat template is ``template``."""
    def make(template: str) -> Path:
        path = tmp_path_factory.mktemp("template") / "tiny"
        shutil.copytree(pocketllm_tiny_llama, path)
        (path / "chat_template.jinja").write_text(template, encoding="utf-8")
        return path

    return make


@pytest.fixture(scope="session")
def tiny_hermes(tiny_with_template: Callable[[str], Path]) -> Path:
    """The tiny checkpoint with a template that renders tools in the hermes format (the kit's ignores them)."""
    return tiny_with_template(HERMES_TEMPLATE)


@pytest.fixture(scope="session")
def echo_llm(tiny_args: EngineArgs) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(engine_args=tiny_args)
    yield llm
    llm.shutdown()


def gated_echo(args: EngineArgs) -> tuple[AsyncLLM, StepGate]:
    """An engine on ``args`` whose backend is echo behind a GatedBackend, and the gate its steps wait on."""
    registry = BackendRegistry()
    gated = GatedBackend.install(registry, "echo")
    return AsyncLLM(engine_args=dataclasses.replace(args, backend=gated.name), registry=registry), gated.gate


@pytest.fixture(scope="session")
def gated(tiny_args: EngineArgs) -> Iterator[tuple[AsyncLLM, StepGate]]:
    llm, gate = gated_echo(tiny_args)
    yield llm, gate
    gate.reset()  # a held gate must not keep the engine from ending its requests
    llm.shutdown()


@pytest.fixture(scope="session")
def gated_llm(gated: tuple[AsyncLLM, StepGate]) -> AsyncLLM:
    """The session's echo engine whose steps a test controls through the ``gate`` fixture."""
    return gated[0]


@pytest.fixture
def gate(gated: tuple[AsyncLLM, StepGate]) -> Iterator[StepGate]:
    """The gate of ``gated_llm``'s steps: open, with nothing seen, at the start of each test and after it."""
    gate = gated[1]
    gate.reset()
    yield gate
    gate.reset()


@pytest.fixture(scope="session")
def torch_llm(pocketllm_tiny_llama: Path) -> Iterator[AsyncLLM]:
    pytest.importorskip("pocketllm_torch")
    llm = AsyncLLM(engine_args=EngineArgs(model=str(pocketllm_tiny_llama), backend="torch", device="cpu"))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def live_server() -> Iterator[Callable[..., LiveServer]]:
    """Factory: ``live_server(app)`` starts a server that is stopped at the end of the session."""
    servers: list[LiveServer] = []

    def start(app: Starlette) -> LiveServer:
        server = LiveServer(app).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@contextmanager
def running(app: Starlette) -> Iterator[LiveServer]:
    server = LiveServer(app).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def serve_app() -> Callable[[Starlette], Any]:
    """``with serve_app(app) as server:`` a server that stops at the end of the block."""
    return running


@pytest.fixture(scope="session")
def echo_server(live_server: Callable[..., LiveServer], tiny_args: EngineArgs, echo_llm: AsyncLLM) -> LiveServer:
    return live_server(create_app(tiny_args, served_model_name=MODEL_NAME, llm=echo_llm))


@pytest.fixture(scope="session")
def gated_server(live_server: Callable[..., LiveServer], gated_llm: AsyncLLM) -> LiveServer:
    return live_server(create_app(gated_llm.args, served_model_name=MODEL_NAME, llm=gated_llm))


@pytest.fixture(scope="session")
def torch_server(live_server: Callable[..., LiveServer], torch_llm: AsyncLLM) -> LiveServer:
    return live_server(create_app(torch_llm.args, served_model_name=MODEL_NAME, llm=torch_llm))


@pytest.fixture(scope="session")
def smol_server(live_server: Callable[..., LiveServer]) -> Iterator[LiveServer]:
    """The default model on the cpp backend (what ``auto`` picks on x86 CPUs), which has grammars, served as
    ``tiny``: the client-library tests' real model."""
    pytest.importorskip("pocketllm_cpp")
    args = EngineArgs(model="smollm2-135m-instruct", backend="cpp")
    llm = AsyncLLM(engine_args=args)
    yield live_server(create_app(args, served_model_name=MODEL_NAME, llm=llm))
    llm.shutdown()


@pytest.fixture
def client(echo_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=echo_server.url, timeout=30) as client:
        yield client


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def server_process(args: list[str], wait_for: Callable[..., bool] | None = None, env: dict[str, str] | None = None):
    """``pocketllm-server ARGS --port <free>`` in a subprocess, yielded as (process, url) once /ready answers;
    killed at the end if still running."""
    port = free_port()
    script = Path(sys.executable).with_name("pocketllm-server")
    process = subprocess.Popen([str(script), *args, "--port", str(port)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return httpx.get(f"{url}/ready", timeout=1).status_code == 200
        except httpx.TransportError:
            return process.poll() is not None

    try:
        assert (wait_for or _wait_for)(ready, timeout=60) and process.poll() is None, process.poll()
        yield process, url
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
