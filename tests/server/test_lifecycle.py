"""Readiness while the model loads, load failures, backpressure, draining, and the console script's signals."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

import pocketllm_server.app_state
from pocketllm import AsyncLLM, BackendStats, EngineArgs
from pocketllm.testing import StepGate
from pocketllm_server import create_app
from tests.server.conftest import free_port, gated_echo, server_process

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 3}


def test_ready_is_503_until_the_model_is_loaded(serve_app, tiny_args: EngineArgs, wait_for,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real_load = pocketllm_server.app_state.load_engine

    def slow_load(args: EngineArgs) -> AsyncLLM:
        release.wait(30)
        return real_load(args)

    monkeypatch.setattr(pocketllm_server.app_state, "load_engine", slow_load)
    with serve_app(create_app(tiny_args, served_model_name="tiny")) as server, \
            httpx.Client(base_url=server.url) as client:
        assert client.get("/alive").status_code == 200
        assert client.get("/ready").status_code == 503
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "loading"
        response = client.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["code"] == "model_loading"
        assert client.get("/v1/models").json()["data"][0]["max_model_len"] is None

        release.set()
        assert wait_for(lambda: client.get("/ready").status_code == 200)
        health = client.get("/health").json()
        assert health["status"] == "ok" and health["backend"] == "echo" and health["engine_alive"] is True
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        llm = server.app.state.server.llm
    # The app loaded this engine, so stopping the app shut it down.
    assert not llm.is_alive


def test_a_model_that_fails_to_load(serve_app, wait_for) -> None:
    args = EngineArgs(model="/no/such/checkpoint", backend="echo")
    with serve_app(create_app(args, served_model_name="x")) as server, httpx.Client(base_url=server.url) as client:
        assert wait_for(lambda: client.get("/health").status_code == 503)
        health = client.get("/health").json()
        assert health["status"] == "failed" and "no/such/checkpoint" in health["error"]
        assert client.get("/ready").status_code == 503
        response = client.post("/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 503 and response.json()["error"]["code"] == "model_load_failed"


def test_health_reports_the_engine(client: httpx.Client) -> None:
    health = client.get("/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "model": "tiny", "backend": "echo", "engine_alive": True,
                             "num_requests_running": 0, "num_requests_waiting": 0, "error": None}
    assert client.get("/alive").json() == {"status": "alive"}
    assert client.get("/ready").json() == {"status": "ready"}


def test_queue_full_is_503_with_retry_after(serve_app, tiny_args: EngineArgs, echo_llm: AsyncLLM,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    waiting = 0
    monkeypatch.setattr(echo_llm, "stats", lambda: BackendStats(num_waiting=waiting))
    app = create_app(tiny_args, served_model_name="tiny", max_queue_len=3, llm=echo_llm)
    with serve_app(app) as server, httpx.Client(base_url=server.url) as client:
        waiting = 2
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        waiting = 3
        for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "x", "temperature": 0})):
            response = client.post(path, json=body)
            assert response.status_code == 503 and response.headers["retry-after"] == "1"
            assert response.json()["error"] == {"message": response.json()["error"]["message"],
                                                "type": "service_unavailable", "param": None, "code": "queue_full"}
        assert client.get("/health").json()["num_requests_waiting"] == 3


def test_queue_full_with_a_real_queue(serve_app, pocketllm_tiny_llama: Path, wait_for) -> None:
    pytest.importorskip("pocketllm_torch")
    llm = AsyncLLM(engine_args=EngineArgs(model=str(pocketllm_tiny_llama), backend="torch", device="cpu",
                                          max_num_seqs=1))
    long = {"prompt": "the sea", "temperature": 0, "max_tokens": 300, "ignore_eos": True, "stream": True}
    try:
        app = create_app(llm.args, served_model_name="tiny", max_queue_len=1, llm=llm)
        with serve_app(app) as server, httpx.Client(base_url=server.url, timeout=60) as client, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            with client.stream("POST", "/v1/completions", json=long) as running:
                lines = running.iter_lines()
                next(lines)
                # The only sequence slot is taken: this one waits (its response has not started).
                queued = pool.submit(client.post, "/v1/completions", json={**long, "stream": False, "max_tokens": 2})
                assert wait_for(lambda: llm.stats().num_waiting == 1)
                rejected = client.post("/v1/completions", json={**long, "stream": False})
                assert rejected.status_code == 503 and rejected.json()["error"]["code"] == "queue_full"
            assert queued.result(60).status_code == 200
    finally:
        llm.shutdown()


def test_shutdown_aborts_in_flight_requests(serve_app, tiny_args: EngineArgs, wait_for,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    gates: list[StepGate] = []

    def load_gated(args: EngineArgs) -> AsyncLLM:  # the app's own engine, which its shutdown stops
        llm, gate = gated_echo(args)
        gates.append(gate)
        return llm

    monkeypatch.setattr(pocketllm_server.app_state, "load_engine", load_gated)
    app = create_app(tiny_args, served_model_name="tiny")
    with serve_app(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        state = app.state.server
        assert wait_for(lambda: client.get("/ready").status_code == 200)
        [gate] = gates
        gate.hold()  # after a few tokens: the request is in flight until something ends it
        gate.release(3)
        body = {**CHAT, "stream": True, "max_tokens": 400, "ignore_eos": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            started = time.monotonic()
            server.call(state.shutdown())  # what the console script does on SIGTERM
            rest = [line for line in lines if line]
        assert time.monotonic() - started < 2.0
        assert rest[-1] == "data: [DONE]"
        # The cut stream ends with an error event naming the cause; "abort" is no finish reason OpenAI knows.
        error = json.loads(rest[-2].removeprefix("data: "))["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "request_aborted")
        assert "shutting down" in error["message"]
        assert all("abort" not in line for line in rest[:-2])
        assert client.get("/ready").status_code == 503
        after = client.post("/v1/chat/completions", json=CHAT)
        assert after.status_code == 503 and after.json()["error"]["code"] == "shutting_down"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_console_script_serves_then_stops_on_a_signal(pocketllm_tiny_llama: Path, sig: signal.Signals,
                                                      wait_for) -> None:
    with server_process(["--model", str(pocketllm_tiny_llama), "--backend", "echo", "--max-queue-len", "8",
                          "--log-level", "info"], wait_for, {"POCKETLLM_PLUGINS": "echo"}) as (process, url):
        models = httpx.get(f"{url}/v1/models").json()
        assert models["data"][0]["id"] == pocketllm_tiny_llama.name  # the default served name: the basename
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "temperature": 0, "max_tokens": 3})
        assert response.status_code == 200
        process.send_signal(sig)
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 0, output
    assert "loading model" in output and "ready on backend echo" in output


def test_console_script_exits_1_when_the_model_cannot_load() -> None:
    script = Path(sys.executable).with_name("pocketllm-server")
    result = subprocess.run([str(script), "--model", "/no/such/model", "--backend", "echo", "--port",
                             str(free_port())], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "POCKETLLM_PLUGINS": "echo"})
    assert result.returncode == 1
    assert "could not load model /no/such/model" in result.stderr


def test_console_script_exits_1_when_the_engine_dies(pocketllm_tiny_llama: Path, wait_for) -> None:
    """A dead engine serves nothing: the process says so and exits non-zero, for a supervisor to restart it."""
    pytest.importorskip("pocketllm_flawed")
    with server_process(["--model", str(pocketllm_tiny_llama), "--backend", "flawed-dies"],
                         wait_for) as (process, url):
        fatal = {"prompt": "hello", "temperature": 1.0, "seed": 13, "max_tokens": 3}
        response = httpx.post(f"{url}/v1/completions", json=fatal, timeout=30)
        assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
        output, _ = process.communicate(timeout=30)
    assert process.returncode == 1, output
    assert "the engine stopped" in output and "fell off the bus" in output


def test_console_script_exits_1_when_the_port_is_taken(pocketllm_tiny_llama: Path) -> None:
    script = Path(sys.executable).with_name("pocketllm-server")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        result = subprocess.run([str(script), "--model", str(pocketllm_tiny_llama), "--backend", "echo", "--port",
                                 str(taken.getsockname()[1])], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "cannot listen on 127.0.0.1" in result.stderr and "loading model" not in result.stderr


def test_engine_death_is_reported_not_hidden(serve_app, tiny_args: EngineArgs) -> None:
    llm, gate = gated_echo(tiny_args)
    gate.release(4)
    gate.fail_next_step(RuntimeError("the accelerator fell off"))
    body = {**CHAT, "stream": True, "max_tokens": 50}
    try:
        with serve_app(create_app(tiny_args, served_model_name="tiny", llm=llm)) as server, \
                httpx.Client(base_url=server.url) as client:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200
                events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "engine_dead" and "accelerator fell off" in error["message"]
            health = client.get("/health").json()
            assert health["status"] == "dead" and "RuntimeError: the accelerator fell off" in health["error"]
            assert health["num_requests_running"] == health["num_requests_waiting"] == 0
            assert client.get("/health").status_code == client.get("/ready").status_code == 503
            after = client.post("/v1/chat/completions", json=CHAT)
            assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"
    finally:
        llm.shutdown()
