"""POST /v1/embeddings: a string, strings, token ids or lists of them, pooled by the engine beside generation."""

from __future__ import annotations

import asyncio
import base64
import time

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from pocketllm import AsyncLLM, EmbeddingOutput, PocketLLMError, PoolingParams
from pocketllm_server.app_state import ServerState, read_model_request
from pocketllm_server.errors import from_engine_error, invalid_request
from pocketllm_server.generation import request_id
from pocketllm_server.protocol import (
    MAX_PROMPTS,
    Embedding,
    EmbeddingList,
    EmbeddingRequest,
    EmbeddingUsage,
    json_response,
)
from pocketllm_server.streaming import all_or_nothing, cancel_on_disconnect

# Engine fields by the request field a client sees in an error (Ollama's /api/embed names them alike).
EMBEDDING_FIELDS = {"prompt": "input", "embeddings": "model", "pooling_type": "model"}


async def create_embedding(request: Request) -> Response:
    state, req, llm = await read_model_request(request, EmbeddingRequest)
    rid = request_id(request, "embd")
    params = PoolingParams(pooling_type=state.pooling_type, normalize=req.normalize, dimensions=req.dimensions)
    try:
        prompts = await asyncio.to_thread(_inputs, req.input, llm)  # tokenizing grows with the input
    except PocketLLMError as e:
        raise from_engine_error(e, fields=EMBEDDING_FIELDS) from None
    if req.truncate_prompt_tokens is not None:  # as vLLM: the last tokens are kept
        prompts = [ids[-req.truncate_prompt_tokens:] for ids in prompts]
    outputs = await embed_all(request, state, llm, prompts, params, rid)
    num_tokens = sum(len(ids) for ids in prompts)
    usage = EmbeddingUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)
    # Off the event loop: encoding grows with inputs times dimensions (2,048 of them make megabytes).
    return await asyncio.to_thread(_response, outputs, req.encoding_format, usage, rid=rid,
                                   model=state.served_model_name)


async def embed_all(request: Request, state: ServerState, llm: AsyncLLM, prompts: list[list[int]],
                    params: PoolingParams, rid: str) -> list[EmbeddingOutput]:
    """Each tokenized input's embedding, batched in the engine beside generation (also Ollama's /api/embed): each
    input is an engine request, admitted together, cancelled if the client leaves."""
    try:
        state.check_queue(len(prompts), "input")
        outputs = await cancel_on_disconnect(request.receive, all_or_nothing([
            llm.embed_ids(ids, params, request_id=rid if len(prompts) == 1 else f"{rid}-{i}")
            for i, ids in enumerate(prompts)]))
    except PocketLLMError as e:
        raise from_engine_error(e, fields=EMBEDDING_FIELDS) from None
    state.metrics.prompt_tokens.inc(sum(len(ids) for ids in prompts))
    return outputs


def _response(outputs: list[EmbeddingOutput], encoding_format: str, usage: EmbeddingUsage, *, rid: str,
              model: str) -> Response:
    data = [Embedding(index=i, embedding=_encoded(o.embedding, encoding_format)) for i, o in enumerate(outputs)]
    body = EmbeddingList(id=rid, created=int(time.time()), model=model, data=data, usage=usage)
    return json_response(body, headers={"X-Request-Id": rid})


def _inputs(value: str | list[str | int | list[int]], llm: AsyncLLM) -> list[list[int]]:
    """Each input's token ids: a string, strings, token ids, or lists of token ids (one kind per request)."""
    items: list[str | list[int]]
    if isinstance(value, str):
        items = [value]
    elif value and all(isinstance(v, int) for v in value):
        items = [[v for v in value if isinstance(v, int)]]
    elif value and (all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value)):
        items = [v for v in value if not isinstance(v, int)]
    else:
        raise invalid_request("input must be a non-empty string, list of strings, list of token ids, or list of "
                              "token-id lists, without mixing them", "input")
    if len(items) > MAX_PROMPTS:
        raise invalid_request(f"input has {len(items)} items; at most {MAX_PROMPTS} are allowed", "input")
    if any(not item for item in items):
        raise invalid_request("input must not contain an empty string or an empty list of token ids", "input")
    return [llm.encode_prompt(item)[1] for item in items]


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":  # OpenAI's: the little-endian float32 bytes
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
