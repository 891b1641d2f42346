"""The HTTP side of the serve workload: concurrent streaming ``/v1/completions`` clients (httpx), timed.

Each run opens one connection per request, sends every request at once (one asyncio task each) and reads the
server-sent events as raw bytes: a chunk's arrival time is when its bytes were read. The client runs in the
bench process, on the same cores as the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from pocketbench.engines import RequestTiming

DONE = b"[DONE]"


class ServeError(RuntimeError):
    pass


class EventStream:
    """Incremental server-sent-events parser: bytes in, the ``data`` payload of each complete event out."""

    def __init__(self) -> None:
        self.buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        self.buffer += data
        *events, self.buffer = self.buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        return [payload for event in events if (payload := _data(event)) is not None]


def _data(event: bytes) -> bytes | None:
    """The event's ``data:`` lines joined with newlines (None for an event without any, e.g. a comment)."""
    lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None


@dataclass
class StreamTally:
    """One request's stream as it arrives: times (seconds from the run's start) and counts."""

    sent_s: float
    first_token_s: float | None = None
    last_token_s: float | None = None
    num_chunks: int = 0  # chunks with a choice: each carries the text of one or more new tokens
    completion_tokens: int | None = None  # from the usage chunk (stream_options.include_usage)
    done: bool = False

    def add(self, payload: bytes, now: float) -> None:
        if payload == DONE:
            self.done = True
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise ServeError(f"the server reported an error mid-stream: {chunk['error']}")
        if chunk.get("choices"):
            self.num_chunks += 1
            self.first_token_s = now if self.first_token_s is None else self.first_token_s
            self.last_token_s = now
        if chunk.get("usage"):
            self.completion_tokens = chunk["usage"]["completion_tokens"]

    def timing(self) -> RequestTiming:
        if not self.done or self.first_token_s is None or self.last_token_s is None or self.completion_tokens is None:
            raise ServeError(f"incomplete stream: {self}")
        if self.num_chunks > self.completion_tokens:
            raise ServeError(f"{self.num_chunks} chunks for {self.completion_tokens} tokens")
        return RequestTiming(self.sent_s, self.first_token_s, self.last_token_s, self.completion_tokens,
                             self.num_chunks)


def completion_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """The request of one client: the same greedy, EOS-ignoring generation as the library side."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def run_clients(url: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One run: ``len(prompts)`` concurrent streaming requests; a reply shaped like a worker's ``serve`` reply."""
    return asyncio.run(_run(url, prompts, max_tokens))


async def _run(url: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits, trust_env=False) as client:
        start = time.perf_counter()
        timings = await asyncio.gather(*(_request(client, completion_body(p, max_tokens), start) for p in prompts))
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "timings": [dataclasses.asdict(t) for t in timings]}


async def _request(client: httpx.AsyncClient, body: dict[str, Any], start: float) -> RequestTiming:
    tally = StreamTally(time.perf_counter() - start)
    events = EventStream()
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise ServeError(f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}")
        async for data in response.aiter_raw():
            now = time.perf_counter() - start
            for payload in events.feed(data):
                tally.add(payload, now)
    return tally.timing()
