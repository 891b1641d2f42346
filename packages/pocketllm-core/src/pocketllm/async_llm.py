"""The asyncio library API: the engine loop runs on its own thread, callers await events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from pocketllm.client import EngineClient, Messages, OutputCollector, Prompt, embedding_of
from pocketllm.outputs import RequestOutput, StreamEvent
from pocketllm.pooling import EmbeddingOutput, PoolingParams
from pocketllm.sampling_params import SamplingParams


class _AsyncStream:
    """Receives events on the engine thread and hands them to one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[StreamEvent | BaseException] = asyncio.Queue()

    def __call__(self, item: StreamEvent | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    async def next(self) -> StreamEvent:
        item = await self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncLLM(EngineClient):
    """Async twin of :class:`pocketllm.LLM`. Construction loads the model and blocks;
    use ``await asyncio.to_thread(AsyncLLM, ...)`` inside a running loop.
    """

    async def generate(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                       request_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """Yield events as tokens arrive. Closing the iterator (or cancelling its task) cancels the request."""
        _, ids = self.encode_prompt(prompt)
        async for event in self.stream_ids(ids, sampling_params, request_id=request_id):
            yield event

    async def chat_stream(self, messages: Messages, sampling_params: SamplingParams | None = None, *,
                          request_id: str | None = None, **chat_kwargs: Any) -> AsyncIterator[StreamEvent]:
        _, ids = self.render_chat(messages, **chat_kwargs)
        async for event in self.stream_ids(ids, sampling_params, request_id=request_id):
            yield event

    async def complete(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                       request_id: str | None = None) -> RequestOutput:
        """Run one prompt to the end and return its output."""
        text, ids = self.encode_prompt(prompt)
        return await self._collect(text, ids, sampling_params, request_id)

    async def chat(self, messages: Messages, sampling_params: SamplingParams | None = None, *,
                   request_id: str | None = None, **chat_kwargs: Any) -> RequestOutput:
        text, ids = self.render_chat(messages, **chat_kwargs)
        return await self._collect(text, ids, sampling_params, request_id)

    async def embed(self, prompt: Prompt, pooling_params: PoolingParams | None = None, *,
                    request_id: str | None = None) -> EmbeddingOutput:
        """The embedding of one prompt (text or token ids); cancelling the task cancels the request."""
        _, ids = self.encode_prompt(prompt)
        return await self.embed_ids(ids, pooling_params, request_id=request_id)

    async def embed_ids(self, prompt_ids: list[int], pooling_params: PoolingParams | None = None, *,
                        request_id: str | None = None) -> EmbeddingOutput:
        loop = asyncio.get_running_loop()
        result: asyncio.Future[StreamEvent | EmbeddingOutput | BaseException] = loop.create_future()

        def sink(item: StreamEvent | EmbeddingOutput | BaseException) -> None:
            loop.call_soon_threadsafe(lambda: result.done() or result.set_result(item))

        request_id, accepted = self._driver.add_embedding(prompt_ids, pooling_params or PoolingParams(), sink,
                                                         request_id)
        answered = False
        try:
            await asyncio.wrap_future(accepted)
            item = await result
            answered = True
            return embedding_of(item)
        finally:
            # Not `result.done()`: cancelling this task cancels the future it awaits, which is then done.
            if not answered:
                self._driver.abort(request_id)

    async def stream_ids(self, prompt_ids: list[int], sampling_params: SamplingParams | None = None, *,
                         request_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """Stream a request given as token ids; errors in the request surface before the first event."""
        stream = _AsyncStream(asyncio.get_running_loop())
        params = sampling_params or SamplingParams()
        grammar = None
        if params.structured_outputs is not None:
            # Refused before it compiles; then compiled on the core's compile threads (the first one also builds
            # llguidance's view of the vocabulary, ~0.5 s) and awaited, so that no thread of this loop's waits.
            self._driver.check_request(prompt_ids, params)
            grammar = await self._driver.grammars.compile_async(params.structured_outputs)
        request_id, accepted = self._driver.add_request(prompt_ids, params, stream, request_id, grammar=grammar)
        finished = False
        try:
            await asyncio.wrap_future(accepted)
            while not finished:
                event = await stream.next()
                finished = event.usage is not None
                yield event
        finally:
            if not finished:
                self._driver.abort(request_id)

    async def _collect(self, text: str | None, ids: list[int], params: SamplingParams | None,
                       request_id: str | None) -> RequestOutput:
        params = params or SamplingParams()
        collector: OutputCollector | None = None
        async for event in self.stream_ids(ids, params, request_id=request_id):
            collector = collector or OutputCollector(event.request_id, text, ids, params.n)
            collector.add(event)
        assert collector is not None
        return collector.output
