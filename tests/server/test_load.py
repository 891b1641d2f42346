"""Dozens of concurrent streams, a third of them dropped by their clients: afterwards nothing is left running,
waiting or holding KV blocks, and admission control counts only what waits for a slot."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from pocketllm import AsyncLLM, EngineArgs
from pocketllm_server import create_app

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
