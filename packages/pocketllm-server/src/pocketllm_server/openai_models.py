"""GET /v1/models: the one model this server serves."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from pocketllm_server.app_state import state_of
from pocketllm_server.protocol import ModelCard, ModelList, json_response


async def list_models(request: Request) -> Response:
    state = state_of(request)
    card = ModelCard(id=state.served_model_name, created=state.created, owned_by="pocketllm",
                     root=state.engine_args.model, max_model_len=state.llm.max_model_len if state.llm else None)
    return json_response(ModelList(data=[card]))
