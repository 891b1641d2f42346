"""Slow grammar compiles over HTTP (issue 31, item 3): they run on the core's own compile threads, so plain
requests never wait behind them; a full compile queue is a 503 with Retry-After, a compile past its time limit a
400 naming the limit, and a compile given up on does not keep new ones waiting. The tiny model on the torch
backend, whose compiles are held on an event where a test says so."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from pocketllm import AsyncLLM, EngineArgs
from pocketllm.grammar_pool import CompilePool
from pocketllm.limits import GRAMMAR_COMPILE_STACK_BYTES
from pocketllm.structured import CompiledGrammar, GrammarCompiler, StructuredOutputs
from pocketllm.testing import engine_driver
from pocketllm_server import create_app
from tests.server.conftest import LiveServer

CHAT = "/v1/chat/completions"
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


class HeldCompiles:
    """Compiles of regexes that start with "held" wait for ``release``; ``running`` counts those under way."""

    def __init__(self, grammars: GrammarCompiler) -> None:
        self.release = threading.Event()
        self._compile = grammars._compile
        self._lock = threading.Lock()
        self.running = 0

    def __call__(self, spec: StructuredOutputs) -> CompiledGrammar:
        if spec.regex is not None and spec.regex.startswith("held"):
            with self._lock:
                self.running += 1
            self.release.wait(60)
        return self._compile(spec)


@pytest.fixture(scope="module")
def served(live_server: Callable[..., LiveServer], pocketllm_tiny_llama: Path) -> Iterator[tuple[str, AsyncLLM]]:
    llm = AsyncLLM(EngineArgs(model=str(pocketllm_tiny_llama), backend="torch", device="cpu"))
    server = live_server(create_app(llm.args, served_model_name="tiny", llm=llm))
    yield server.url, llm
    llm.shutdown()


@pytest.fixture
def held(served: tuple[str, AsyncLLM], monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldCompiles]:
    """One compile thread, one queued compile at most, and compiles that wait where a test says."""
    grammars = engine_driver(served[1]).grammars
    monkeypatch.setattr(grammars, "_pool", CompilePool(1, 1, GRAMMAR_COMPILE_STACK_BYTES, name="test-grammar"))
    held = HeldCompiles(grammars)
    monkeypatch.setattr(grammars, "_compile", held)
    yield held
    held.release.set()


def post(url: str, **fields: Any) -> httpx.Response:
    return httpx.post(f"{url}{CHAT}", json=BODY | fields, timeout=60)


def test_plain_requests_do_not_wait_behind_compiles_and_a_full_queue_is_a_503(
        served: tuple[str, AsyncLLM], held: HeldCompiles, monkeypatch: pytest.MonkeyPatch,
        wait_for: Callable[..., bool]) -> None:
    """Eight held compiles: more than asyncio's default threads here (min(32, CPUs + 4)), which they used to
    hold while they waited, so that a plain chat's template rendering waited behind them."""
    url, llm = served
    grammars = engine_driver(llm).grammars
    monkeypatch.setattr(grammars, "_pool", CompilePool(1, 8, GRAMMAR_COMPILE_STACK_BYTES, name="test-grammar"))
    assert post(url, guided_regex="cached[0-9]").status_code == 200  # compiled before the threads are taken
    with ThreadPoolExecutor(9) as clients:
        waiting = [clients.submit(post, url, guided_regex=f"held-{i}[0-9]") for i in range(8)]
        assert wait_for(lambda: held.running == 1 and grammars._pool.queued() == 7, timeout=30)
        for fields in ({}, {"guided_regex": "cached[0-9]"}):  # no compile to wait for
            assert post(url, **fields).status_code == 200
        assert not held.release.is_set() and not any(w.done() for w in waiting)
        queued = clients.submit(post, url, guided_regex="held-8[0-9]")
        assert wait_for(lambda: grammars._pool.queued() == 8, timeout=30) and not queued.done()
        full = post(url, guided_regex="one-too-many[0-9]")
        assert full.status_code == 503 and full.headers["retry-after"] == "1", full.text
        assert full.json()["error"]["code"] == "overloaded"
        held.release.set()
        assert all(w.result().status_code == 200 for w in [*waiting, queued])


def test_a_compile_past_its_time_limit_is_a_400_and_keeps_no_thread(
        served: tuple[str, AsyncLLM], held: HeldCompiles, monkeypatch: pytest.MonkeyPatch,
        wait_for: Callable[..., bool]) -> None:
    url, llm = served
    grammars = engine_driver(llm).grammars
    monkeypatch.setattr(grammars, "timeout_s", 0.5)
    late = post(url, guided_regex="held-late[0-9]")
    assert late.status_code == 400, late.text
    error = late.json()["error"]
    assert error["param"] == "guided_regex" and "took more than 0.5 s to compile (the limit)" in error["message"]
    assert held.running == 1 and not held.release.is_set()  # still compiling, on the one thread
    assert post(url, guided_regex="after-late[0-9]").status_code == 200  # on a spare thread meanwhile
    held.release.set()
    assert wait_for(lambda: grammars._pool.queued() == 0 and not grammars._pool._jobs, timeout=30)
    assert not any("held-late" in key for key in grammars._cache)  # the given-up compile's result is dropped
