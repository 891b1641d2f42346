"""Dozens of concurrent streams, a third of them dropped by their clients: afterwards nothing is left running,
waiting or holding KV blocks, and admission control counts only what waits for a slot."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pocketllm import AsyncLLM, BackendStats, EngineArgs
from pocketllm.testing import engine_driver
from pocketllm_server import create_app
from pocketllm_server.protocol import MAX_LOGIT_BIAS_TOKENS, MAX_PROMPTS

pytest.importorskip("pocketllm_torch")

STREAM = {"prompt": "the sea and the ships", "temperature": 0, "max_tokens": 40, "ignore_eos": True,
          "stream": True}


async def _stream(client: httpx.AsyncClient, i: int) -> str:
    async with client.stream("POST", "/v1/completions", json={**STREAM, "seed": i}) as response:
        assert response.status_code == 200
        lines = response.aiter_lines()
        async for line in lines:
            if line.startswith("data: ") and i % 3 == 0:
                return "dropped"  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                return "done"
    return "cut"


def _metric(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def test_streams_with_disconnects_leave_nothing_behind(serve_app, torch_llm: AsyncLLM, wait_for) -> None:
    with serve_app(create_app(torch_llm.args, served_model_name="tiny", llm=torch_llm)) as server:
        async def main() -> list[str]:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as client:
                return await asyncio.gather(*(_stream(client, i) for i in range(48)))

        outcomes = asyncio.run(main())
        assert outcomes.count("dropped") == 16 and outcomes.count("done") == 32

        def idle() -> bool:
            metrics = httpx.get(f"{server.url}/metrics").text
            return all(_metric(metrics, f"pocketllm:{name}") == 0
                       for name in ("num_requests_running", "num_requests_waiting", "kv_cache_blocks_used"))

        assert wait_for(idle, timeout=30)
        assert _metric(httpx.get(f"{server.url}/metrics").text, "pocketllm:kv_cache_blocks_total") > 0


def test_max_queue_len_counts_waiting_not_running(serve_app, pocketllm_tiny_llama: Path) -> None:
    """A burst of 40 with 32 slots and --max-queue-len 4: 32 run, 4 wait, the rest are told to retry."""
    llm = AsyncLLM(EngineArgs(model=str(pocketllm_tiny_llama), backend="torch", max_num_seqs=32))
    body = {"prompt": "the sea", "temperature": 0, "max_tokens": 60, "ignore_eos": True}
    try:
        with serve_app(create_app(llm.args, served_model_name="tiny", llm=llm, max_queue_len=4)) as server:
            async def main() -> list[int]:
                async with httpx.AsyncClient(base_url=server.url, timeout=120,
                                             limits=httpx.Limits(max_connections=64)) as client:
                    responses = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(40)))
                    return [r.status_code for r in responses]

            statuses = asyncio.run(main())
        assert statuses.count(200) >= 36, statuses
        assert set(statuses) <= {200, 503}
    finally:
        llm.shutdown()


def test_a_batch_of_2048_prompts_leaves_the_event_loop_free(serve_app, echo_llm: AsyncLLM,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Each prompt's parameters and engine request used to be made on the event loop, all in one turn of it:
    20,000 one-token prompts held it for seconds (/health took 9 s). Here each add takes a millisecond, and
    /health, sent once the first is added, must be answered while the rest are still being added."""
    driver = engine_driver(echo_llm)
    add_request = driver.add_request
    added = 0
    adding = threading.Event()

    def slow_add_request(*args: Any, **kwargs: Any) -> Any:
        nonlocal added
        adding.set()
        time.sleep(0.001)
        added += 1
        return add_request(*args, **kwargs)

    monkeypatch.setattr(driver, "add_request", slow_add_request)
    body = {"prompt": [[5]] * MAX_PROMPTS, "max_tokens": 1, "temperature": 0}
    with serve_app(create_app(echo_llm.args, served_model_name="tiny", llm=echo_llm)) as server:
        async def main() -> tuple[httpx.Response, httpx.Response, int]:
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                batch = asyncio.create_task(client.post("/v1/completions", json=body))
                assert await asyncio.to_thread(adding.wait, 60)
                health = await client.get("/health")
                added_by_then = added
                return await batch, health, added_by_then

        response, health, added_by_then = asyncio.run(main())
    assert response.status_code == 200 and len(response.json()["choices"]) == MAX_PROMPTS
    assert health.status_code == 200 and added_by_then < MAX_PROMPTS


def test_prompts_per_request_are_bounded(client: httpx.Client) -> None:
    for path, field in (("/v1/completions", "prompt"), ("/v1/embeddings", "input")):
        response = client.post(path, json={field: [[5]] * (MAX_PROMPTS + 1), "max_tokens": 1, "temperature": 0})
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == field and str(MAX_PROMPTS) in error["message"]


def test_max_queue_len_counts_every_prompt_and_choice(serve_app, echo_llm: AsyncLLM,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """--max-queue-len 3 with 32 slots. A batch used to count as one request, whatever its prompts and n."""
    stats = BackendStats(num_running=32, num_waiting=1)  # every slot taken, one waiting
    monkeypatch.setattr(echo_llm, "stats", lambda: stats)
    completion = {"prompt": ["a", "b"], "max_tokens": 2, "temperature": 0}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0, "n": 2}
    with serve_app(create_app(echo_llm.args, served_model_name="tiny", llm=echo_llm, max_queue_len=3)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as client:
        def status(path: str, body: dict[str, Any]) -> tuple[int, str | None]:
            response = client.post(path, json=body)
            return response.status_code, response.json().get("error", {}).get("code")

        assert status("/v1/completions", completion) == (200, None)  # 1 + 2 wait
        assert status("/v1/chat/completions", chat) == (200, None)
        assert status("/v1/completions", {**completion, "prompt": ["a", "b", "c"]}) == (503, "queue_full")
        assert status("/v1/completions", {**completion, "n": 2}) == (503, "queue_full")
        assert status("/v1/chat/completions", {**chat, "n": 3}) == (503, "queue_full")
        stats = BackendStats()  # idle: new sequences take the free slots first
        assert status("/v1/completions", {**completion, "prompt": ["a"] * 35}) == (200, None)
        assert status("/v1/completions", {**completion, "prompt": ["a"] * 36}) == (400, "too_many_sequences")
        assert status("/v1/chat/completions", {**chat, "n": 16}) == (200, None)


def test_logit_bias_is_bounded(client: httpx.Client) -> None:
    """Each engine request checks every biased token: 150,000 of them held the event loop 0.3 s per request."""
    bias = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS_TOKENS + 1)}
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "logit_bias": bias})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "logit_bias"
    assert str(MAX_LOGIT_BIAS_TOKENS) in error["message"]
