"""A client that leaves mid-request frees its engine request at once; many concurrent streams all finish intact."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pocketllm import AsyncLLM
from pocketllm.testing import StepGate

DISCONNECTS = "pocketllm:client_disconnect_cancellations_total"
LONG_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 400,
             "ignore_eos": True}
LONG_COMPLETION = {"model": "tiny", "prompt": "the sea", "temperature": 0, "max_tokens": 400, "ignore_eos": True}
STEPS_BEFORE_LEAVING = 8  # tokens enough for the events a leaving client reads, and far fewer than max_tokens


def disconnects(url: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return next(s.value for f in families for s in f.samples if s.name == DISCONNECTS)


def idle(llm: AsyncLLM) -> bool:
    stats = llm.stats()
    return stats.num_running == stats.num_waiting == 0


@pytest.mark.parametrize(("path", "body"), [("/v1/chat/completions", LONG_CHAT),
                                            ("/v1/completions", {**LONG_COMPLETION, "prompt": ["a", "b"], "n": 2})])
def test_leaving_mid_stream_aborts_the_request(gated_server, gated_llm: AsyncLLM, gate: StepGate, wait_for,
                                               path: str, body: dict[str, Any]) -> None:
    gate.hold()
    gate.release(STEPS_BEFORE_LEAVING)
    before = disconnects(gated_server.url)
    with httpx.Client(base_url=gated_server.url) as client, \
            client.stream("POST", path, json={**body, "stream": True}) as response:
        events = (line for line in response.iter_lines() if line)
        assert all(next(events).startswith("data: ") for _ in range(4))
        assert gated_llm.stats().num_running >= 1
    # The engine is held and runs no further step: only an abort can end the request now.
    assert wait_for(lambda: idle(gated_llm), timeout=2)
    assert wait_for(lambda: disconnects(gated_server.url) == before + 1)


@pytest.mark.parametrize(("stream", "steps"), [(False, 5), (True, 0)])
def test_leaving_before_the_response_starts_aborts_the_request(gated_server, gated_llm: AsyncLLM, gate: StepGate,
                                                               wait_for, stream: bool, steps: int) -> None:
    """Non-streaming: the client gives up while the engine runs; streaming: before its first token."""
    gate.hold()
    gate.release(steps)
    before = disconnects(gated_server.url)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gated_server.url}/v1/completions", json={**LONG_COMPLETION, "stream": stream}, timeout=0.1)
    assert gate.wait_added(1, timeout=1)  # it reached the engine, where no step can end it
    assert wait_for(lambda: idle(gated_llm), timeout=1)
    assert wait_for(lambda: disconnects(gated_server.url) == before + 1)


def test_leaving_mid_stream_frees_kv_blocks(torch_server, torch_llm: AsyncLLM, wait_for) -> None:
    with httpx.Client(base_url=torch_server.url) as client, \
            client.stream("POST", "/v1/completions", json={**LONG_COMPLETION, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        # Engine stats are refreshed after each step's events are out: give them a step to catch up.
        assert wait_for(lambda: torch_llm.stats().num_running == 1)
        assert torch_llm.stats().num_kv_blocks_used > 0
    assert wait_for(lambda: (torch_llm.stats().num_running, torch_llm.stats().num_kv_blocks_used)
                    == (0, 0), timeout=2)


def test_sixteen_concurrent_streams(gated_server, gated_llm: AsyncLLM, gate: StepGate) -> None:
    gate.hold()  # until every stream is in the engine

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
        async with openai.AsyncOpenAI(base_url=f"{gated_server.url}/v1", api_key="x", max_retries=0) as sdk:
            clients = asyncio.gather(*(client(sdk, i) for i in range(16)))
            try:
                assert await asyncio.to_thread(gate.wait_added, 16), f"{len(gate.added)} of 16 in the engine"
            finally:
                gate.open()
            return await clients

    results = asyncio.run(main())
    assert gate.batch_sizes[0] == 16  # they really ran together
    for i, (text, usage) in enumerate(results):
        _, prompt_ids = gated_llm.render_chat([{"role": "user", "content": f"client number {i}"}])
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 10 + i)
        expected = [prompt_ids[k % len(prompt_ids)] for k in range(10 + i)]
        assert text == gated_llm.tokenizer.decode(expected)
