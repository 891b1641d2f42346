"""GET /v1/models and /v1/models/{model}: the one model this server serves, in OpenAI's shapes, or in Anthropic's
for Anthropic's clients (its Models API has the same paths)."""

from __future__ import annotations

from datetime import datetime, timezone

from starlette.requests import Request
from starlette.responses import Response

from pocketllm_server.anthropic_protocol import ModelInfo, ModelInfoList
from pocketllm_server.app_state import ServerState, state_of
from pocketllm_server.errors import anthropic_client
from pocketllm_server.protocol import ModelCard, ModelList, json_response


async def list_models(request: Request) -> Response:
    state = state_of(request)
    if anthropic_client(request.scope):
        info = _model_info(state)
        return json_response(ModelInfoList(data=[info], has_more=False, first_id=info.id, last_id=info.id))
    return json_response(ModelList(data=[_model_card(state)]))


async def retrieve_model(request: Request) -> Response:
    state = state_of(request)
    state.check_model(request.path_params["model"])  # a 404 for any other name
    return json_response(_model_info(state) if anthropic_client(request.scope) else _model_card(state))


def _model_card(state: ServerState) -> ModelCard:
    return ModelCard(id=state.served_model_name, created=state.created, owned_by="pocketllm",
                     root=state.engine_args.model, max_model_len=_max_model_len(state))


def _model_info(state: ServerState) -> ModelInfo:
    return ModelInfo(id=state.served_model_name, display_name=state.served_model_name,
                     created_at=datetime.fromtimestamp(state.created, timezone.utc),
                     max_input_tokens=_max_model_len(state))


def _max_model_len(state: ServerState) -> int | None:
    return state.llm.max_model_len if state.llm else None  # None while the model loads
