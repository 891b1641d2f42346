"""The synchronous library API."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from typing import Any

from pocketllm.client import (
    EngineClient,
    Messages,
    OutputCollector,
    Prompt,
    embedding_of,
    normalize_conversations,
    normalize_prompts,
    per_prompt_params,
)
from pocketllm.outputs import RequestOutput, StreamEvent
from pocketllm.pooling import EmbeddingOutput, PoolingParams
from pocketllm.sampling_params import SamplingParams


class _Stream:
    """A request's events, consumed by one thread."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[StreamEvent | BaseException] = queue.SimpleQueue()

    def __call__(self, item: StreamEvent | BaseException) -> None:
        self.queue.put(item)

    def next(self) -> StreamEvent:
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


class RequestStream(Iterator[StreamEvent]):
    """A running request's events. ``close()`` (or dropping it) before the end cancels the request at the next
    step boundary, whether or not any event was read.

    The request is queued when the stream is made, not accepted: the engine takes new requests between steps, so
    the first ``next()`` raises the engine's refusal where it refused. Streams made one after another therefore join
    the same step, rather than each waiting out the step that runs when it is made."""

    def __init__(self, llm: LLM, request_id: str, stream: _Stream, accepted: Future[None]) -> None:
        self.request_id = request_id
        self._llm = llm
        self._stream = stream
        self._accepted: Future[None] | None = accepted
        self._finished = False

    def __next__(self) -> StreamEvent:
        if self._finished:
            raise StopIteration
        if self._accepted is not None:
            refused = self._accepted.exception()  # an interrupt while waiting leaves the request to close()
            self._accepted = None
            if refused is not None:
                self._finished = True  # nothing of it runs, and nothing is left to cancel
                raise refused
        event = self._stream.next()
        self._finished = event.usage is not None
        return event

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            refused = self._accepted is not None and self._accepted.done() and self._accepted.exception() is not None
            if not refused:  # a refused request is gone, and its id may already name another
                self._llm.abort(self.request_id)

    def __del__(self) -> None:
        self.close()


class _Collected:
    """A request's events, kept until it finishes. The caller is woken once, not per token: on a
    machine with as many cores as torch threads, a waking consumer stalls the engine's kernels."""

    def __init__(self) -> None:
        self.events: list[StreamEvent] = []
        self.error: BaseException | None = None
        self.done = threading.Event()

    def __call__(self, item: StreamEvent | BaseException) -> None:
        if isinstance(item, BaseException):
            self.error = item
            self.done.set()
            return
        self.events.append(item)
        if item.usage is not None:
            self.done.set()

    def wait(self) -> list[StreamEvent]:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.events


class _Embedded:
    """An embedding request's one result, waited for by one thread."""

    def __init__(self) -> None:
        self.item: StreamEvent | EmbeddingOutput | BaseException | None = None
        self.done = threading.Event()

    def __call__(self, item: StreamEvent | EmbeddingOutput | BaseException) -> None:
        self.item = item
        self.done.set()

    def wait(self) -> EmbeddingOutput:
        self.done.wait()
        assert self.item is not None
        return embedding_of(self.item)


class LLM(EngineClient):
    """Generate from text, token ids or chat messages; every call blocks until its requests finish.

    >>> llm = LLM("smollm2-135m-instruct")
    >>> llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=8))[0].outputs[0].text
    """

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | Sequence[
                 SamplingParams] | None = None, *, request_ids: Sequence[str] | None = None) -> list[RequestOutput]:
        """Run every prompt as one batch and return their outputs in order."""
        items = normalize_prompts(prompts)
        encoded = [self.encode_prompt(p) for p in items]
        return self._run_batch(encoded, per_prompt_params(sampling_params, len(items)), request_ids)

    def chat(self, messages: Messages | list[Messages], sampling_params: SamplingParams | Sequence[
             SamplingParams] | None = None, *, add_generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             request_ids: Sequence[str] | None = None) -> list[RequestOutput]:
        """Chat with one conversation or a batch of them."""
        conversations = normalize_conversations(messages)
        encoded = [self.render_chat(c, add_generation_prompt=add_generation_prompt, tools=tools,
                                    chat_template_kwargs=chat_template_kwargs) for c in conversations]
        return self._run_batch(encoded, per_prompt_params(sampling_params, len(encoded)), request_ids)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None, *,
              request_ids: Sequence[str] | None = None) -> list[EmbeddingOutput]:
        """The embedding of each prompt (text or token ids), in order, run as one batch (and beside any
        generation under way)."""
        items = normalize_prompts(prompts)
        params = pooling_params or PoolingParams()
        submitted: list[tuple[str, _Embedded]] = []
        try:
            acceptances = []
            for i, prompt in enumerate(items):
                _, ids = self.encode_prompt(prompt)
                sink = _Embedded()
                rid, accepted = self._driver.add_embedding(ids, params, sink, request_ids[i] if request_ids else None)
                submitted.append((rid, sink))
                acceptances.append(accepted)
            for accepted in acceptances:
                accepted.result()
            return [sink.wait() for _, sink in submitted]
        except BaseException:
            for rid, sink in submitted:
                if not sink.done.is_set():
                    self._driver.abort(rid)
            raise

    def generate_stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
                        request_id: str | None = None) -> RequestStream:
        """Yield events as tokens arrive; closing the iterator early cancels the request."""
        _, ids = self.encode_prompt(prompt)
        return self._stream(ids, sampling_params or SamplingParams(), request_id)

    def chat_stream(self, messages: Messages, sampling_params: SamplingParams | None = None, *,
                    request_id: str | None = None, **chat_kwargs: Any) -> RequestStream:
        _, ids = self.render_chat(messages, **chat_kwargs)
        return self._stream(ids, sampling_params or SamplingParams(), request_id)

    def _stream(self, ids: list[int], params: SamplingParams, request_id: str | None) -> RequestStream:
        stream = _Stream()
        request_id, accepted = self._driver.add_request(ids, params, stream, request_id)
        return RequestStream(self, request_id, stream, accepted)

    def _run_batch(self, encoded: list[tuple[str | None, list[int]]], params: list[SamplingParams],
                   request_ids: Sequence[str] | None) -> list[RequestOutput]:
        submitted: list[tuple[str, _Collected, OutputCollector]] = []
        try:
            # Submit everything before waiting on any acceptance, so the whole batch joins the same step.
            acceptances = []
            for i, ((text, ids), p) in enumerate(zip(encoded, params, strict=True)):
                sink = _Collected()
                rid, accepted = self._driver.add_request(ids, p, sink, request_ids[i] if request_ids else None)
                submitted.append((rid, sink, OutputCollector(rid, text, ids, p.n)))
                acceptances.append(accepted)
            for accepted in acceptances:
                accepted.result()
            for _, sink, collector in submitted:
                for event in sink.wait():
                    collector.add(event)
        except BaseException:
            for rid, _, collector in submitted:
                if not collector.output.finished:
                    self._driver.abort(rid)
            raise
        return [collector.output for _, _, collector in submitted]
