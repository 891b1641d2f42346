"""Errors: one exception type that carries its HTTP status, answered in the error format of the API that was asked
(OpenAI's for /v1, Anthropic's for /v1/messages and for Anthropic's clients on /v1/models, Ollama's for /api)."""

from __future__ import annotations

import msgspec
from starlette.responses import Response
from starlette.types import Scope

from pocketllm.errors import (
    ConfigError,
    EngineDeadError,
    OverloadedError,
    PocketLLMError,
    PromptTooLongError,
    RequestCancelledError,
    UnsupportedOptionError,
)

# Seconds a client should wait before retrying a 503 (loading, overloaded, shutting down).
RETRY_AFTER_S = 1


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers or {}

    def response(self, scope: Scope) -> Response:
        """The answer in the error format of the API that the request ``scope`` was made to."""
        body = error_body(scope["path"], self, anthropic=anthropic_client(scope))
        return Response(msgspec.json.encode(body), status_code=self.status, headers=self.headers,
                        media_type="application/json")


class AnthropicErrorInfo(msgspec.Struct):
    type: str
    message: str


class AnthropicErrorBody(msgspec.Struct, tag_field="type", tag="error"):
    """Anthropic's error body: ``{"type": "error", "error": {"type": ..., "message": ...}}``."""

    error: AnthropicErrorInfo


class OllamaErrorBody(msgspec.Struct):
    error: str


# Anthropic's error types by HTTP status (its API documents these; 529 is its "overloaded").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}
ANTHROPIC_PREFIX = "/v1/messages"
OLLAMA_PREFIX = "/api/"
MODELS_PATH = "/v1/models"  # both OpenAI's API and Anthropic's have it, each in its own shapes
_ANTHROPIC_VERSION = b"anthropic-version"  # sent by Anthropic's clients on every request, by nobody else's


def anthropic_client(scope: Scope) -> bool:
    """Whether the request comes from one of Anthropic's clients (ASGI gives header names in lower case)."""
    return any(name == _ANTHROPIC_VERSION for name, _ in scope["headers"])


def anthropic_error(error: APIError) -> AnthropicErrorBody:
    kind = _ANTHROPIC_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return AnthropicErrorBody(AnthropicErrorInfo(type=kind, message=error.info.message))


ErrorBodies = ErrorBody | AnthropicErrorBody | OllamaErrorBody


def error_body_type(path: str, *, anthropic: bool = False) -> type[ErrorBodies]:
    """The error format of the API that ``path`` belongs to; ``anthropic``: Anthropic's on the paths both APIs
    have, for a request from Anthropic's clients."""
    if _under(path, ANTHROPIC_PREFIX) or (anthropic and _under(path, MODELS_PATH)):
        return AnthropicErrorBody
    if path.startswith(OLLAMA_PREFIX):
        return OllamaErrorBody
    return ErrorBody


def _under(path: str, prefix: str) -> bool:
    return path == prefix or path.startswith(prefix + "/")


def error_body(path: str, error: APIError, *, anthropic: bool = False) -> ErrorBodies:
    kind = error_body_type(path, anthropic=anthropic)
    if kind is AnthropicErrorBody:
        return anthropic_error(error)
    if kind is OllamaErrorBody:
        return OllamaErrorBody(error.info.message)
    return ErrorBody(error.info)


def invalid_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def unavailable(message: str, code: str) -> APIError:
    """503 with Retry-After: the request was fine, the server cannot take it now."""
    return APIError(503, message, type="service_unavailable", code=code,
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def from_engine_error(error: PocketLLMError, *, fields: dict[str, str] | None = None) -> APIError:
    """Map an engine error to its HTTP answer; ``fields`` renames SamplingParams fields to request fields."""
    fields = fields or {}
    if isinstance(error, ConfigError):
        return invalid_request(str(error), fields.get(error.field, error.field))
    if isinstance(error, UnsupportedOptionError):
        option = error.option.split(".")[0]
        return APIError(400, str(error), param=fields.get(option, option), code="unsupported_option")
    if isinstance(error, PromptTooLongError):
        return APIError(400, str(error), param=fields.get("prompt", "prompt"), code="context_length_exceeded")
    if isinstance(error, EngineDeadError):
        return unavailable(str(error), "engine_dead")
    if isinstance(error, OverloadedError):
        return unavailable(str(error), "overloaded")
    if isinstance(error, RequestCancelledError):  # with its client still there, only a shutdown cancels
        return unavailable(f"{error}: the server is shutting down", "request_aborted")
    return APIError(500, f"{type(error).__name__}: {error}", type="internal_server_error")
