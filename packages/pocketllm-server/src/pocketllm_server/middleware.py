"""ASGI middleware: request body limits and connection hygiene, the API-key check, and the last line of defence
against unexpected exceptions."""

from __future__ import annotations

import hmac
import logging
import zlib
from urllib.parse import urlsplit, urlunsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pocketllm_server.errors import OLLAMA_PREFIX, APIError
from pocketllm_server.web_ui import DEFAULTS_PATH

log = logging.getLogger("pocketllm_server")


def _is_protected(path: str) -> bool:
    # The chat page's files stay open (they hold no secret); its defaults are API data.
    return (path == "/v1" or path.startswith(("/v1/", OLLAMA_PREFIX))
            or path in ("/tokenize", "/detokenize", "/tokenizer_info", DEFAULTS_PATH))


class ApiKeyMiddleware:
    """The key on the API (/v1, Ollama's /api, /tokenize, /detokenize), as ``Authorization: Bearer <key>`` or as
    Anthropic's clients send it, ``x-api-key: <key>``; /health, /alive, /ready and /metrics stay open for probes."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    def _accepts(self, headers: Headers) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken must not tell how much of a guessed key was right.
        bearer = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key)
        x_api_key = headers.get("x-api-key")
        return bearer or (x_api_key is not None and hmac.compare_digest(x_api_key.strip().encode(), self.api_key))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and _is_protected(scope["path"]) and not self._accepts(Headers(scope=scope)):
            error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' or "
                                  "'x-api-key: <key>'.", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
            log_error_answer(scope, error)
            await error.response(scope)(scope, receive, send)
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
            log.exception("unexpected error handling %s", describe(scope))
            if not started:  # once headers are out, closing the connection is all that is left
                error = APIError(500, f"The server had an error while processing the request ({type(e).__name__}).",
                                 type="internal_server_error")
                await error.response(scope)(scope, receive, send)


class ClientRequestIdMiddleware:
    """Sends a client's X-Request-Id back on every response to it, errors included.

    It replaces the server's own id in that header; the server's id, unique where clients' ids need not be,
    stays the body's ``id`` and keys the engine requests (see ``generation.request_id``).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_id = client_request_id(scope) if scope["type"] == "http" else None
        if client_id is None:
            await self.app(scope, receive, send)
            return

        async def echoing_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(name, value) for name, value in message.get("headers", []) if name != _REQUEST_ID]
                message = {**message, "headers": [*headers, (_REQUEST_ID, client_id)]}
            await send(message)

        await self.app(scope, receive, echoing_send)


_REQUEST_ID = b"x-request-id"


def client_request_id(scope: Scope) -> bytes | None:
    """The X-Request-Id the client sent, as sent (ASGI gives header names in lower case)."""
    return next((value for name, value in scope["headers"] if name == _REQUEST_ID and value), None)


_LOGGED_ID_CHARS = 128
_LOGGED_MESSAGE_CHARS = 500  # messages name fields and limits; a grammar's compile error may quote some of it


def describe(scope: Scope) -> str:
    """A request as the log names it: method, path, the server's id once a route made one, and the client's
    X-Request-Id, so that either side's id finds it."""
    parts = [scope["method"], scope["path"]]
    server_id = scope.get("state", {}).get("request_id")
    if server_id is not None:
        parts.append(server_id)
    client_id = client_request_id(scope)
    if client_id is not None:
        parts.append(f"X-Request-Id {client_id.decode('latin-1')[:_LOGGED_ID_CHARS]!r}")
    return " ".join(parts)


def log_error_answer(scope: Scope, error: APIError) -> None:
    """Say in the log why a request was answered with ``error``, at info for a refusal (a 4xx, or a 503 for load):
    the status, type, code, param and message, never the request's text."""
    info = error.info
    details = "".join(f", {name} {value}" for name, value in (("code", info.code), ("param", info.param)) if value)
    level = logging.WARNING if error.status >= 500 and error.status != 503 else logging.INFO
    log.log(level, "answered %s with %d %s%s: %s", describe(scope), error.status, info.type, details,
            info.message[:_LOGGED_MESSAGE_CHARS])


class RelativeRedirectMiddleware:
    """Makes every redirect's ``Location`` a path on this server.

    Starlette writes absolute ones (its trailing-slash redirects: ``/ui`` to ``/ui/``) from the request's Host
    header, which the client chose: echoed, it would send a browser on to any host. A path is resolved against
    the URL the client asked for, so it stays on whatever host and scheme that was.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def relative_send(message: Message) -> None:
            if message["type"] == "http.response.start" and 300 <= message["status"] < 400:
                headers = [(name, _path_only(value) if name.lower() == b"location" else value)
                           for name, value in message.get("headers", [])]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, relative_send)


def _path_only(location: bytes) -> bytes:
    url = urlsplit(location)
    # One leading slash: "//host/..." would name a host again.
    return urlunsplit((b"", b"", b"/" + url.path.lstrip(b"/"), url.query, url.fragment))


class BodyTooLarge(APIError):
    def __init__(self, limit: int, *, decoded: bool = False) -> None:
        body = "The request body, decoded," if decoded else "The request body"
        super().__init__(413, f"{body} is larger than this server accepts ({limit} bytes).", code="request_too_large")


# Content-Encoding values a request body may have, and zlib's window bits for each (gzip's header, or zlib's).
_CODINGS = {"identity": 0, "gzip": 31, "x-gzip": 31, "deflate": 15}


class _Inflater:
    """A gzip or deflate request body decoded as it arrives. Its decoded bytes count against the same limit as a
    plain body's, and the decoder never produces more than one byte past it: a small body that would inflate to
    gigabytes costs only that. Gzip members that follow each other are one body, as gzip writes them; anything
    after a deflate stream's end, or after the last gzip member, is a 400."""

    def __init__(self, coding: str, limit: int) -> None:
        self._coding = coding
        self._wbits = _CODINGS[coding]
        self._decoder = zlib.decompressobj(wbits=self._wbits)
        self._limit = limit
        self._produced = 0

    def feed(self, data: bytes, last: bool) -> bytes:
        out = bytearray()
        try:
            while True:
                # At most one byte past the limit: where that much comes out, the body is too large, decoded.
                out += self._decoder.decompress(data, self._limit - self._produced - len(out) + 1)
                if self._produced + len(out) > self._limit:
                    raise BodyTooLarge(self._limit, decoded=True)
                if not (self._decoder.eof and self._decoder.unused_data):
                    break
                if self._wbits != _CODINGS["gzip"]:
                    raise APIError(400, "the request body has data after its deflate stream", param="content-encoding")
                data = self._decoder.unused_data  # the next gzip member
                self._decoder = zlib.decompressobj(wbits=self._wbits)
        except zlib.error as e:
            raise APIError(400, f"the request body is not valid {self._coding} data ({e})",
                           param="content-encoding") from None
        self._produced += len(out)
        if last and not self._decoder.eof:
            raise APIError(400, f"the request body's {self._coding} data ends early", param="content-encoding")
        return bytes(out)


class RequestBodyMiddleware:
    """Bounds request bodies, decodes gzip and deflate ones, and closes connections whose body was not read.

    A body announced larger than ``max_body_bytes`` is answered 413 before any of it is read; one that turns out
    larger while it is read (or, decoded, larger than that) fails its read with the same 413. Either way, and
    whenever any reply (a 401, 404, 405, 415, ...) starts before the app read the whole body, the reply carries
    ``Connection: close``: the unread rest of the body must not be taken for the next request on a keep-alive
    connection. A Content-Encoding other than identity, gzip and deflate is a 415.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length")
        has_body = bool(declared and declared != "0") or "transfer-encoding" in headers
        body_read = not has_body
        received = 0
        coding = headers.get("content-encoding", "identity").strip().lower() or "identity"
        inflater = _Inflater(coding, self.max_body_bytes) if has_body and _CODINGS.get(coding) else None

        async def counting_receive() -> Message:
            nonlocal body_read, received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge(self.max_body_bytes)
                body_read = not message.get("more_body", False)
                if inflater is not None:
                    message = {**message, "body": inflater.feed(message.get("body", b""), body_read)}
            return message

        async def closing_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not body_read:
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        error: APIError | None = None
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            error = BodyTooLarge(self.max_body_bytes) if declared.isdigit() else APIError(
                400, f"invalid Content-Length header {declared[:40]!r}")
        elif has_body and coding not in _CODINGS:
            error = APIError(415, f"Content-Encoding {coding[:40]!r} is not supported: send the body as is, or in "
                             "gzip or deflate", param="content-encoding", code="unsupported_media_type")
        if error is not None:
            log_error_answer(scope, error)
            await error.response(scope)(scope, receive, closing_send)
            return
        await self.app(scope, counting_receive, closing_send)
