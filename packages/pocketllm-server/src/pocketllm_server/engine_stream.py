"""One engine request's events as the server streams them, with its metrics recorded as they pass by."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from pocketllm import StreamEvent
from pocketllm_server.metrics import ServerMetrics


class EngineStream:
    """One engine request's events, with the first already pulled; records metrics as events pass by.

    Close it (``aclose``) when done: closing before the end aborts the request in the engine.
    """

    def __init__(self, metrics: ServerMetrics, events: AsyncGenerator[StreamEvent, None],
                 num_prompt_tokens: int) -> None:
        self.metrics = metrics
        self.events = events
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = time.monotonic()
        self.first: StreamEvent | None = None
        self.finished = False
        self._last_output: dict[int, float] = {}  # per choice index

    async def pull_first(self) -> None:
        self.first = await anext(self.events)
        now = time.monotonic()
        self.metrics.request_queue_time.observe(now - self.arrival)
        self.metrics.time_to_first_token.observe(now - self.arrival)
        self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        self._record(self.first, now)

    def __aiter__(self) -> AsyncIterator[StreamEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamEvent]:
        assert self.first is not None
        yield self.first
        while not self.finished:
            event = await anext(self.events)
            self._record(event, time.monotonic())
            yield event

    def _record(self, event: StreamEvent, now: float) -> None:
        m = self.metrics
        m.generation_tokens.inc(len(event.token_ids))
        last = self._last_output.get(event.index)
        if last is not None and event.token_ids:
            m.inter_token_latency.observe(now - last)
        self._last_output[event.index] = now
        if event.finish_reason is not None and event.finish_reason != "abort":
            m.request_success(event.finish_reason)
        if event.usage is not None:
            self.finished = True
            m.e2e_request_latency.observe(now - self.arrival)

    async def aclose(self) -> None:
        await self.events.aclose()
