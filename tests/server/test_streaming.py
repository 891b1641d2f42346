"""A client that leaves mid-request frees its engine request at once; many concurrent streams all finish intact."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pocketllm import AsyncLLM

DISCONNECTS = "pocketllm:client_disconnect_cancellations_total"
LONG_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 400,
             "ignore_eos": True}
LONG_COMPLETION = {"model": "tiny", "prompt": "the sea", "temperature": 0, "max_tokens": 400, "ignore_eos": True}


def slow_down(llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch, delay: float) -> list[int]:
    """Make each engine step take ``delay`` seconds (echo is otherwise done before a client can leave).

    Returns a list that records how many requests were running at each step.
    """
    engine = llm.driver.engine
    step, running = engine.step, []

    def slow_step() -> Any:
        time.sleep(delay)
        running.append(len(engine.requests))
        return step()

    monkeypatch.setattr(engine, "step", slow_step)
    return running


def disconnects(url: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return next(s.value for f in families for s in f.samples if s.name == DISCONNECTS)


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", LONG_CHAT),
                                            ("/v1/completions", {**LONG_COMPLETION, "prompt": ["a", "b"], "n": 2})])
def test_leaving_mid_stream_aborts_the_request(echo_server, echo_llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch,
                                               wait_for, path: str, body: dict[str, Any]) -> None:
    slow_down(echo_llm, monkeypatch, 0.005)
    before = disconnects(echo_server.url)
    with httpx.Client(base_url=echo_server.url) as client, \
            client.stream("POST", path, json={**body, "stream": True}) as response:
        events = (line for line in response.iter_lines() if line)
        assert all(next(events).startswith("data: ") for _ in range(4))
        assert echo_llm.driver.stats().num_running >= 1
    left = time.monotonic()
    assert wait_for(lambda: echo_llm.driver.stats().num_running == 0, timeout=2)
    assert time.monotonic() - left < 0.5  # a few steps at most, not the 2 s the rest would take
    assert wait_for(lambda: disconnects(echo_server.url) == before + 1)


@pytest.mark.parametrize(("stream", "step_delay"), [(False, 0.005), (True, 0.2)])
def test_leaving_before_the_response_starts_aborts_the_request(echo_server, echo_llm: AsyncLLM,
                                                               monkeypatch: pytest.MonkeyPatch, wait_for,
                                                               stream: bool, step_delay: float) -> None:
    """Non-streaming: the client gives up while the engine runs; streaming: while the first token is computed."""
    slow_down(echo_llm, monkeypatch, step_delay)
    before = disconnects(echo_server.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{echo_server.url}/v1/completions", json={**LONG_COMPLETION, "stream": stream}, timeout=0.1)
    assert wait_for(lambda: echo_llm.driver.stats().num_running == 0, timeout=1)
    assert wait_for(lambda: disconnects(echo_server.url) == before + 1)


def test_leaving_mid_stream_frees_kv_blocks(torch_server, torch_llm: AsyncLLM, wait_for) -> None:
    with httpx.Client(base_url=torch_server.url) as client, \
            client.stream("POST", "/v1/completions", json={**LONG_COMPLETION, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        # Engine stats are refreshed after each step's events are out: give them a step to catch up.
        assert wait_for(lambda: torch_llm.driver.stats().num_running == 1)
        assert torch_llm.driver.stats().num_kv_blocks_used > 0
    assert wait_for(lambda: (torch_llm.driver.stats().num_running, torch_llm.driver.stats().num_kv_blocks_used)
                    == (0, 0), timeout=2)


def test_sixteen_concurrent_streams(echo_server, echo_llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    running = slow_down(echo_llm, monkeypatch, 0.002)

    async def client(sdk: openai.AsyncOpenAI, i: int) -> tuple[str, Any]:
        stream = await sdk.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"client number {i}"}], temperature=0,
            max_tokens=10 + i, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
            usage = chunk.usage or usage
        return text, usage

    async def main() -> list[tuple[str, Any]]:
        async with openai.AsyncOpenAI(base_url=f"{echo_server.url}/v1", api_key="x", max_retries=0) as sdk:
            return await asyncio.gather(*(client(sdk, i) for i in range(16)))

    results = asyncio.run(main())
    assert max(running) > 8  # they really ran together
    for i, (text, usage) in enumerate(results):
        _, prompt_ids = echo_llm.render_chat([{"role": "user", "content": f"client number {i}"}])
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 10 + i)
        expected = [prompt_ids[k % len(prompt_ids)] for k in range(10 + i)]
        assert text == echo_llm.tokenizer.decode(expected)
