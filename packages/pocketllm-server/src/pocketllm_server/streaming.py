"""Server-sent events, and noticing that the client went away.

An ASGI server tells the app about a closed connection only through
``receive()`` returning ``http.disconnect``; nothing interrupts an app that is
waiting on the engine. So work on behalf of a client runs next to a task that
watches ``receive()``, and is cancelled when the client leaves: cancelling the
engine stream aborts the request at the next step boundary.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import msgspec
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
STARTS_PER_ITERATION = 32


def sse(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def sse_event(name: str, payload: Any) -> bytes:
    """A named event (Anthropic's and the Responses API's streams name each event after its ``type``)."""
    return b"event: " + name.encode() + b"\n" + sse(payload)


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def cancel_on_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise Starlette's ClientDisconnect.

    Only call this once the request body has been read: from then on ``receive()`` has nothing else to say.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled() and watcher.done() and not watcher.cancelled():
        raise ClientDisconnect
    return task.result()


async def all_or_nothing(work: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run concurrently and return every result; on the first error (or cancellation) cancel the rest and wait.

    At most ``STARTS_PER_ITERATION`` begin per turn of the event loop: a coroutine may start with synchronous work
    (adding an engine request checks its prompt and parameters), and a batch of 2,048 started at once would
    hold the loop, and every other request, for all of it.
    """
    tasks: list[asyncio.Future[T]] = []
    try:
        for begin in range(0, len(work), STARTS_PER_ITERATION):
            if tasks:
                await asyncio.sleep(0)  # the previous slice runs its first steps; other requests get a turn
            tasks += [asyncio.ensure_future(w) for w in work[begin:begin + STARTS_PER_ITERATION]]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            error = task.exception()
            if error is not None:
                raise error
        return [task.result() for task in tasks]
    finally:
        for coroutine in work[len(tasks):]:  # cancelled before these were started
            coroutine.close()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class EventStreamResponse(Response):
    """Streams ``events`` (already-encoded SSE frames) and closes them however the response ends."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], *, headers: dict[str, str],
                 on_disconnect: Callable[[], None]) -> None:
        self.events = events
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for frame in self.events:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await cancel_on_disconnect(receive, stream())
        except ClientDisconnect:
            self.on_disconnect()
        finally:
            # Cancellation may have hit ``send`` rather than the generator; close it either way.
            await self.events.aclose()


async def merge(streams: Sequence[AsyncIterable[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several streams as they arrive, tagged with the stream's position. An error in one ends all."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, T] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterable[T]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
        except Exception as e:
            queue.put_nowait(e)
        else:
            queue.put_nowait(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            entry = await queue.get()
            if entry is None:
                remaining -= 1
            elif isinstance(entry, BaseException):
                raise entry
            else:
                yield entry
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
