"""ASGI middleware: the API-key check, and the last line of defence against unexpected exceptions."""

from __future__ import annotations

import hmac
import logging

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pocketllm_server.errors import APIError

log = logging.getLogger("pocketllm_server")


def _is_protected(path: str) -> bool:
    return path == "/v1" or path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


class ApiKeyMiddleware:
    """``Authorization: Bearer <key>`` on the API; /health, /alive, /ready and /metrics stay open for probes."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_protected(scope["path"]):
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            # compare_digest: the time taken must not tell how much of a guessed key was right.
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key):
                error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class UnexpectedErrorMiddleware:
    """Turns an exception no handler expected into a logged 500 with an OpenAI error body.

    Starlette's own handler for this re-raises into the server; here the failure
    stays with the one request that hit it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:
            log.exception("unexpected error handling %s %s", scope["method"], scope["path"])
            if not started:  # once headers are out, closing the connection is all that is left
                error = APIError(500, f"The server had an error while processing the request ({type(e).__name__}).",
                                 type="internal_server_error")
                await error.response()(scope, receive, send)
