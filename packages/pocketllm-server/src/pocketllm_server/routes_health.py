"""Operational endpoints, never behind the API key: /health, /alive, /ready, /metrics."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import Response

from pocketllm_server.app_state import state_of
from pocketllm_server.protocol import HealthResponse, json_response


async def health(request: Request) -> Response:
    """Liveness plus the engine's state: 200 while loading or serving, 503 once it cannot serve anymore."""
    state = state_of(request)
    stats = state.stats()
    llm = state.llm
    if state.load_error is not None:
        status, error = "failed", f"{type(state.load_error).__name__}: {state.load_error}"
    elif llm is None:
        status, error = "loading", None
    elif not llm.is_alive:  # what killed it; its requests were all failed with it
        status, error, stats = "dead", f"{type(llm.error).__name__}: {llm.error}" if llm.error else None, None
    else:
        status, error = "ok", None
    body = HealthResponse(
        status=status, model=state.served_model_name, backend=llm.backend_name if llm is not None else None,
        engine_alive=llm is not None and llm.is_alive,
        num_requests_running=stats.num_running if stats else 0,
        num_requests_waiting=stats.num_waiting if stats else 0, error=error)
    return json_response(body, status=200 if status in ("ok", "loading") else 503)


async def alive(request: Request) -> Response:
    """The process answers HTTP; says nothing about the engine."""
    return json_response({"status": "alive"})


async def ready(request: Request) -> Response:
    """200 once the engine is loaded and running (and the server is not shutting down), else 503."""
    state = state_of(request)
    if state.ready:
        return json_response({"status": "ready"})
    return json_response({"status": "not ready"}, status=503)


async def metrics(request: Request) -> Response:
    return Response(state_of(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)
