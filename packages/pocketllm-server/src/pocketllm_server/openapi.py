"""The OpenAPI 3.1 description of every route, generated from the msgspec request and response structs."""

from __future__ import annotations

import re
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pocketllm_server import anthropic_protocol, ollama_protocol, protocol, responses_protocol
from pocketllm_server.errors import AnthropicErrorBody, ErrorBody, OllamaErrorBody, error_body_type

# method, path, summary, request body, response body (None: not JSON), streams (SSE when "stream": true)
_OPERATIONS: list[tuple[str, str, str, type | None, type | None, bool]] = [
    ("post", "/v1/chat/completions", "Chat completion (OpenAI)", protocol.ChatCompletionRequest,
     protocol.ChatCompletion, True),
    ("post", "/v1/completions", "Text completion (OpenAI)", protocol.CompletionRequest, protocol.Completion, True),
    ("post", "/v1/embeddings", "Embeddings (OpenAI)", protocol.EmbeddingRequest, protocol.EmbeddingList, False),
    ("get", "/v1/models", "The served model (Anthropic's shape for Anthropic's clients)", None, protocol.ModelList,
     False),
    ("get", "/v1/models/{model}", "The served model, by its name (Anthropic's shape for Anthropic's clients)", None,
     protocol.ModelCard, False),
    ("post", "/v1/responses", "Response (OpenAI Responses API)", responses_protocol.ResponsesRequest,
     responses_protocol.ResponseObject, True),
    ("get", "/v1/responses/{response_id}", "A stored response (OpenAI Responses API)", None,
     responses_protocol.ResponseObject, False),
    ("delete", "/v1/responses/{response_id}", "Delete a stored response (OpenAI Responses API)", None,
     responses_protocol.DeletedResponse, False),
    ("post", "/v1/messages", "Message (Anthropic Messages API)", anthropic_protocol.MessagesRequest,
     anthropic_protocol.MessageOut, True),
    ("post", "/v1/messages/count_tokens", "Count a conversation's tokens (Anthropic Messages API)",
     anthropic_protocol.CountTokensRequest, anthropic_protocol.CountTokensResponse, False),
    ("post", "/tokenize", "Tokenize a prompt or a conversation (vLLM)", protocol.TokenizeRequest,
     protocol.TokenizeResponse, False),
    ("post", "/detokenize", "Token ids back to text (vLLM)", protocol.DetokenizeRequest,
     protocol.DetokenizeResponse, False),
    ("get", "/tokenizer_info", "The tokenizer's special tokens and chat template (vLLM)", None,
     protocol.TokenizerInfo, False),
    # Ollama's streams are newline-delimited JSON objects of the response's shape ("stream" is true unless false).
    ("post", "/api/chat", "Chat (Ollama)", ollama_protocol.ChatRequest, ollama_protocol.ChatResponse, False),
    ("post", "/api/generate", "Generate from a prompt (Ollama)", ollama_protocol.GenerateRequest,
     ollama_protocol.GenerateResponse, False),
    ("post", "/api/embed", "Embeddings (Ollama)", ollama_protocol.EmbedRequest, ollama_protocol.EmbedResponse, False),
    ("post", "/api/embeddings", "One embedding, not normalised (Ollama's older route)",
     ollama_protocol.EmbeddingsRequest, ollama_protocol.EmbeddingsResponse, False),
    ("get", "/api/tags", "The served model (Ollama)", None, ollama_protocol.ListResponse, False),
    ("post", "/api/show", "The served model's details (Ollama)", ollama_protocol.ShowRequest,
     ollama_protocol.ShowResponse, False),
    ("get", "/api/ps", "The loaded model (Ollama)", None, ollama_protocol.ProcessResponse, False),
    ("get", "/api/version", "The Ollama API version served", None, ollama_protocol.VersionResponse, False),
    ("get", "/health", "Liveness and engine state", None, protocol.HealthResponse, False),
    ("get", "/alive", "The process answers", None, None, False),
    ("get", "/ready", "The engine is loaded and serving", None, None, False),
    ("get", "/metrics", "Prometheus metrics", None, None, False),
    ("get", "/openapi.json", "This document", None, None, False),
    ("get", "/", "The chat page (off with --no-web-ui)", None, None, False),
    ("get", "/ui/defaults", "The chat page's sampling defaults", None, None, False),
    ("get", "/ui/{path}", "The chat page's scripts and styles", None, None, False),
]
_ERRORS = {"400": "Invalid request", "401": "Missing or wrong API key", "404": "Unknown model or route",
           "413": "Request body too large", "415": "Body is not JSON", "503": "Loading, overloaded or shutting down"}
_PROTECTED_PREFIXES = ("/v1/", "/api/", "/tokenize", "/detokenize", "/tokenizer_info", "/ui/defaults")


def openapi_document(*, title: str, version: str, api_key: bool) -> dict[str, Any]:
    structs = [t for _, _, _, request, response, _ in _OPERATIONS for t in (request, response) if t is not None]
    _, components = msgspec.json.schema_components([*structs, ErrorBody, AnthropicErrorBody, OllamaErrorBody],
                                                   ref_template="#/components/schemas/{name}")
    paths: dict[str, dict[str, Any]] = {}
    for method, path, summary, request, response, streams in _OPERATIONS:
        operation: dict[str, Any] = {"summary": summary, "responses": _responses(response, streams, method, path)}
        parameters = re.findall(r"{(\w+)}", path)
        if parameters:
            operation["parameters"] = [{"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                                       for name in parameters]
        if request is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": _ref(request)}}}
        if api_key and path.startswith(_PROTECTED_PREFIXES):
            operation["security"] = [{"bearer": []}]
        paths.setdefault(path, {})[method] = operation
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        document["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return document


def _ref(struct: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{struct.__name__}"}


def _responses(response: type | None, streams: bool, method: str, path: str) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": _ref(response)}} if response else {
        "application/json": {}, "text/plain": {}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    responses: dict[str, Any] = {"200": {"description": "OK", "content": content}}
    error = {"application/json": {"schema": _ref(error_body_type(path))}}
    for status, description in _ERRORS.items():
        if method == "post" or status in ("404", "503"):
            responses[status] = {"description": description, "content": error}
    return responses


async def openapi_json(request: Request) -> Response:
    return Response(request.app.state.openapi, media_type="application/json")
