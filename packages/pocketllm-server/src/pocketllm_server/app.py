"""The Starlette application: routes, middleware, error handlers and the engine's lifespan."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import msgspec
from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from pocketllm import AsyncLLM, EngineArgs, __version__
from pocketllm.pooling import POOLING_TYPES
from pocketllm.reasoning import REASONING_PARSERS
from pocketllm_server import (
    anthropic_messages,
    ollama_api,
    ollama_models,
    openai_chat,
    openai_completions,
    openai_embeddings,
    openai_models,
    openai_responses,
    routes_health,
    routes_tokenize,
)
from pocketllm_server.app_state import ServerState, state_of
from pocketllm_server.errors import APIError
from pocketllm_server.middleware import (
    ApiKeyMiddleware,
    ClientRequestIdMiddleware,
    RelativeRedirectMiddleware,
    RequestBodyMiddleware,
    UnexpectedErrorMiddleware,
    log_error_answer,
)
from pocketllm_server.openapi import openapi_document, openapi_json
from pocketllm_server.response_store import (
    DEFAULT_MAX_STORED_RESPONSE_BYTES,
    DEFAULT_MAX_STORED_RESPONSES,
    ResponseStore,
)
from pocketllm_server.tool_calls import TOOL_CALL_PARSERS
from pocketllm_server.web_ui import routes as web_ui_routes


class _ModelName(Convertor[str]):
    """A served model's name in a path: any non-empty text, slashes included ("Qwen/Qwen3-0.6B", as vLLM serves a
    Hugging Face id); "/v1/models/" itself still redirects to the list."""

    regex = ".+"

    def convert(self, value: str) -> str:
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("model_name", _ModelName())

# Status for a request whose client left before the answer (nginx's convention; nobody receives it).
_CLIENT_CLOSED_REQUEST = 499


DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a max_model_len of token ids or text is far below this
# "auto": fields a request leaves out take the checkpoint's recommended sampling settings (as vLLM's
# --generation-config auto); "none": OpenAI's defaults.
GENERATION_CONFIG_CHOICES = ("auto", "none")


def create_app(engine_args: EngineArgs, *, served_model_name: str, api_key: str | None = None,
               max_queue_len: int | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               generation_config: str = "auto", llm: AsyncLLM | None = None,
               reasoning_parser: str | None = None, tool_call_parser: str = "auto",
               pooling_type: str | None = None, web_ui: bool = True,
               max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
               max_stored_response_bytes: int = DEFAULT_MAX_STORED_RESPONSE_BYTES) -> Starlette:
    """Build the server. Without ``llm`` the app loads the model itself, in the background, at startup.

    An ``llm`` passed in is used as it is and not shut down with the app.
    """
    if max_queue_len is not None and max_queue_len < 1:
        raise ValueError(f"max_queue_len must be at least 1, got {max_queue_len}")
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be at least 1, got {max_request_bytes}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {reasoning_parser!r}")
    if tool_call_parser not in ("auto", *TOOL_CALL_PARSERS):
        raise ValueError(f"tool_call_parser must be auto or one of {TOOL_CALL_PARSERS}, got {tool_call_parser!r}")
    if pooling_type is not None and pooling_type not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {pooling_type!r}")
    if generation_config not in GENERATION_CONFIG_CHOICES:
        raise ValueError(f"generation_config must be one of {GENERATION_CONFIG_CHOICES}, got {generation_config!r}")
    state = ServerState(engine_args, served_model_name=served_model_name, max_queue_len=max_queue_len, llm=llm,
                        generation_config=generation_config,
                        responses=ResponseStore(max_stored_responses, max_stored_response_bytes))
    state.reasoning_parser = reasoning_parser
    state.tool_call_parser = tool_call_parser
    state.pooling_type = pooling_type

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await state.startup()
        try:
            yield
        finally:
            await state.shutdown()

    routes = [
        Route("/health", routes_health.health, methods=["GET"]),
        Route("/alive", routes_health.alive, methods=["GET"]),
        Route("/ready", routes_health.ready, methods=["GET"]),
        Route("/metrics", routes_health.metrics, methods=["GET"]),
        Route("/v1/models", openai_models.list_models, methods=["GET"]),
        Route("/v1/models/{model:model_name}", openai_models.retrieve_model, methods=["GET"]),
        Route("/v1/chat/completions", openai_chat.create_chat_completion, methods=["POST"]),
        Route("/v1/completions", openai_completions.create_completion, methods=["POST"]),
        Route("/v1/embeddings", openai_embeddings.create_embedding, methods=["POST"]),
        Route("/v1/messages", anthropic_messages.create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic_messages.count_tokens, methods=["POST"]),
        Route("/api/chat", ollama_api.chat, methods=["POST"]),
        Route("/api/generate", ollama_api.generate, methods=["POST"]),
        Route("/api/embed", ollama_api.embed, methods=["POST"]),
        Route("/api/embeddings", ollama_api.embeddings, methods=["POST"]),
        Route("/api/tags", ollama_models.tags, methods=["GET"]),
        Route("/api/show", ollama_models.show, methods=["POST"]),
        Route("/api/ps", ollama_models.ps, methods=["GET"]),
        Route("/api/version", ollama_models.version, methods=["GET"]),
        Route("/v1/responses", openai_responses.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", openai_responses.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", openai_responses.delete_response, methods=["DELETE"]),
        Route("/tokenize", routes_tokenize.tokenize, methods=["POST"]),
        Route("/detokenize", routes_tokenize.detokenize, methods=["POST"]),
        Route("/tokenizer_info", routes_tokenize.tokenizer_info, methods=["GET"]),
        Route("/openapi.json", openapi_json, methods=["GET"]),
        *(web_ui_routes() if web_ui else []),
    ]
    middleware = [Middleware(ClientRequestIdMiddleware),
                  Middleware(RequestBodyMiddleware, max_body_bytes=max_request_bytes),
                  Middleware(UnexpectedErrorMiddleware), Middleware(RelativeRedirectMiddleware)]
    if api_key is not None:
        middleware.append(Middleware(ApiKeyMiddleware, api_key=api_key))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan, exception_handlers={
        APIError: _api_error, HTTPException: _http_error, ClientDisconnect: _client_disconnected})
    app.state.server = state
    app.state.openapi = msgspec.json.encode(openapi_document(title="PocketLLM", version=__version__,
                                                             api_key=api_key is not None))
    return app


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    log_error_answer(request.scope, exc)
    return exc.response(request.scope)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Routing errors (unknown path, wrong method) in the same JSON shape as every other error."""
    assert isinstance(exc, HTTPException)
    message = f"{exc.detail} ({request.method} {request.url.path})"
    return await _api_error(request, APIError(exc.status_code, message, headers=dict(exc.headers or {})))


async def _client_disconnected(request: Request, exc: Exception) -> Response:
    """The client left while its request was read, queued or run (Starlette raises this too, mid-body)."""
    state_of(request).metrics.client_disconnects.inc()
    return Response(status_code=_CLIENT_CLOSED_REQUEST)
