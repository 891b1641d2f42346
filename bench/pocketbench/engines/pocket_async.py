"""The library side of the serve workload: PocketLLM's ``AsyncLLM``, streamed by one asyncio task per request.

The same model, backend, KV sizing and threads as ``pocket.py``; the server process of the HTTP side is
started with the ``backend_options`` this worker reports in its info.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from pocketbench.config import EngineSpec
from pocketbench.engines import RequestTiming
from pocketbench.engines.pocket import BackendSetup, greedy_params
from pocketllm import AsyncLLM, SamplingParams


class AsyncPocketEngine:
    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.setup = BackendSetup.of(spec)
        self.llm = AsyncLLM(spec.model, **self.setup.engine_kwargs(spec))
        self.loop = asyncio.new_event_loop()  # one loop for every run, as a server has

    def info(self) -> dict[str, Any]:
        return {**self.setup.info(self.spec), "api": "AsyncLLM.generate, one asyncio task per request",
                "backend_options": self.setup.options}

    def serve(self, prompts: list[list[int]], max_tokens: int) -> list[RequestTiming]:
        return self.loop.run_until_complete(self._serve(prompts, greedy_params(max_tokens)))

    async def _serve(self, prompts: list[list[int]], params: SamplingParams) -> list[RequestTiming]:
        start = time.perf_counter()
        return list(await asyncio.gather(*(self._request(prompt, params, start) for prompt in prompts)))

    async def _request(self, prompt: list[int], params: SamplingParams, start: float) -> RequestTiming:
        sent = time.perf_counter() - start
        first = last = 0.0
        tokens = events = 0
        async for event in self.llm.generate(prompt, params):
            if event.token_ids:
                last = time.perf_counter() - start
                first = first or last
                tokens += len(event.token_ids)
                events += 1
        return RequestTiming(sent, first, last, tokens, events)
