"""Ollama's API (``/api/*``), so that clients written for Ollama work unchanged.

``/api/chat`` and templated ``/api/generate`` are chat turns (``chat_turn``): the request becomes an OpenAI chat
request (a generate prompt a user message, after its ``system`` message), and the turn's replies or pieces become
Ollama's JSON objects, or its stream of them as newline-delimited JSON. A ``raw`` generate prompt is tokenized as
it is and run as the completions endpoint runs its prompts. ``/api/embed`` and the older ``/api/embeddings`` pool as
``/v1/embeddings`` does; ``/api/tags``, ``/api/show``, ``/api/ps`` and ``/api/version`` (``ollama_models``) describe
the one served model and the API; ``ollama_options`` maps Ollama's request fields onto the engine's.

Ollama loads models on demand and unloads them after ``keep_alive``; this server loads its model at start and
keeps it while it runs, so a ``keep_alive`` Ollama could read is accepted and changes nothing, and an empty prompt
(Ollama's way to load a model) is answered at once with ``done_reason`` "load".
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pocketllm import AsyncLLM, PocketLLMError, PoolingParams
from pocketllm_server.app_state import ServerState, read_model_request
from pocketllm_server.chat_turn import Piece, Turn, TurnUsage, start_turn
from pocketllm_server.errors import APIError, OllamaErrorBody, from_engine_error, invalid_request
from pocketllm_server.generation import (
    PromptRequest,
    request_id,
    sampling_params,
    start_all,
)
from pocketllm_server.ollama_options import (
    OPTION_FIELDS,
    chat_message,
    check_generate,
    check_keep_alive,
    check_logprobs,
    checked_options,
    context_size,
    format_of,
    reply_budget,
    sampling_fields,
    thinking_switch,
)
from pocketllm_server.ollama_protocol import (
    ChatRequest,
    ChatResponse,
    EmbeddingsRequest,
    EmbeddingsResponse,
    EmbedRequest,
    EmbedResponse,
    GenerateRequest,
    GenerateResponse,
    Options,
    ReplyFunction,
    ReplyMessage,
    ReplyToolCall,
    timestamp,
)
from pocketllm_server.openai_embeddings import EMBEDDING_FIELDS, embed_all
from pocketllm_server.protocol import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    ChatMessage,
    ResponseFormat,
    SamplingRequest,
    json_response,
)
from pocketllm_server.streaming import EventStreamResponse
from pocketllm_server.tool_calls import ToolCall

_NS = 1_000_000_000


# -- the routes ----------------------------------------------------------------------------------------------------

async def chat(request: Request) -> Response:
    started = time.monotonic()
    state, req, llm = await read_model_request(request, ChatRequest)
    check_keep_alive(req.keep_alive)
    check_logprobs(req.logprobs)
    opts = checked_options(req.options)
    chat_request = ChatCompletionRequest(
        messages=[chat_message(i, m) for i, m in enumerate(req.messages)], tools=req.tools or None,
        response_format=format_of(req.format), chat_template_kwargs=thinking_switch(llm, state, req.think),
        **sampling_fields(opts))
    if not req.messages:  # Ollama's way to load the model
        return json_response(ChatResponse(model=state.served_model_name, created_at=_now(), done=True,
                                          done_reason="load", message=ReplyMessage(role="assistant", content="")))
    run = await _start_chat(request, state, llm, chat_request, opts, prompt_field="messages")
    clock = _Clock(started, run.stream.arrival, time.monotonic())
    model = state.served_model_name
    if req.stream:
        lines = _lines(run, clock, lambda piece: _chat_line(model, piece),
                       lambda done: ChatResponse(model=model, created_at=_now(), **done,
                                                 message=ReplyMessage(role="assistant", content="")))
        return NDJSONResponse(lines, headers={"X-Request-Id": run.rid},
                              on_disconnect=state.metrics.client_disconnects.inc)
    [reply], usage = await run.replies()
    return json_response(ChatResponse(model=model, created_at=_now(), **clock.done(reply.finish_reason, usage),
                                      message=_message_out(reply.content, reply.reasoning, reply.calls)),
                         headers={"X-Request-Id": run.rid})


async def generate(request: Request) -> Response:
    started = time.monotonic()
    state, req, llm = await read_model_request(request, GenerateRequest)
    check_keep_alive(req.keep_alive)
    check_generate(req)
    opts = checked_options(req.options)
    response_format = format_of(req.format)
    template_kwargs = thinking_switch(llm, state, req.think)
    model = state.served_model_name
    if not req.prompt:  # Ollama's way to load the model
        return json_response(GenerateResponse(model=model, created_at=_now(), response="", done=True,
                                              done_reason="load"))
    if req.raw:
        run = await _start_raw(request, state, llm, req.prompt, opts, response_format)
    else:
        messages = [ChatMessage(role="system", content=req.system)] if req.system else []
        chat_request = ChatCompletionRequest(messages=[*messages, ChatMessage(role="user", content=req.prompt)],
                                             response_format=response_format, chat_template_kwargs=template_kwargs,
                                             **sampling_fields(opts))
        run = await _start_chat(request, state, llm, chat_request, opts, prompt_field="prompt")
    clock = _Clock(started, run.stream.arrival, time.monotonic())
    if req.stream:
        lines = _lines(run, clock, lambda piece: _generate_line(model, piece),
                       lambda done: GenerateResponse(model=model, created_at=_now(), response="", **done))
        return NDJSONResponse(lines, headers={"X-Request-Id": run.rid},
                              on_disconnect=state.metrics.client_disconnects.inc)
    [reply], usage = await run.replies()
    return json_response(GenerateResponse(model=model, created_at=_now(), response=reply.content,
                                          thinking=reply.reasoning or None,
                                          **clock.done(reply.finish_reason, usage)),
                         headers={"X-Request-Id": run.rid})


async def embed(request: Request) -> Response:
    started = time.monotonic()
    state, req, llm = await read_model_request(request, EmbedRequest)
    check_keep_alive(req.keep_alive)
    context = context_size(checked_options(req.options), llm.max_model_len)
    texts = ([req.input] if req.input else []) if isinstance(req.input, str) else req.input
    if len(texts) > MAX_PROMPTS:
        raise invalid_request(f"input has {len(texts)} items; at most {MAX_PROMPTS} are allowed", "input")
    if not all(texts):
        raise invalid_request("input must not contain an empty string", "input")
    if not texts:  # Ollama's way to load the model
        return json_response(EmbedResponse(model=state.served_model_name, embeddings=[]))
    rid = request_id(request, "ollama")
    params = PoolingParams(pooling_type=state.pooling_type, normalize=True, dimensions=req.dimensions)
    try:  # off the event loop: tokenizing grows with the inputs
        prompts = await asyncio.to_thread(_embedding_inputs, llm, texts, context, req.truncate)
    except PocketLLMError as e:
        raise from_engine_error(e, fields=EMBEDDING_FIELDS) from None
    outputs = await embed_all(request, state, llm, prompts, params, rid)
    num_tokens = sum(len(ids) for ids in prompts)
    return json_response(EmbedResponse(model=state.served_model_name, embeddings=[o.embedding for o in outputs],
                                       total_duration=_ns(time.monotonic() - started), load_duration=0,
                                       prompt_eval_count=num_tokens), headers={"X-Request-Id": rid})


async def embeddings(request: Request) -> Response:
    """The older embeddings route, as Ollama still serves it: one prompt, its vector not normalised, and a prompt
    longer than the context refused rather than cut."""
    state, req, llm = await read_model_request(request, EmbeddingsRequest)
    check_keep_alive(req.keep_alive)
    context = context_size(checked_options(req.options), llm.max_model_len)
    if not req.prompt:  # Ollama's way to load the model
        return json_response(EmbeddingsResponse(embedding=[]))
    rid = request_id(request, "ollama")
    try:  # off the event loop: tokenizing grows with the prompt
        prompts = await asyncio.to_thread(_embedding_inputs, llm, [req.prompt], context, False, "prompt")
    except PocketLLMError as e:
        raise from_engine_error(e, fields={**EMBEDDING_FIELDS, "prompt": "prompt"}) from None
    params = PoolingParams(pooling_type=state.pooling_type, normalize=False)
    [output] = await embed_all(request, state, llm, prompts, params, rid)
    return json_response(EmbeddingsResponse(embedding=output.embedding), headers={"X-Request-Id": rid})


async def _start_chat(request: Request, state: ServerState, llm: AsyncLLM, chat_request: ChatCompletionRequest,
                      opts: Options, *, prompt_field: str) -> Turn:
    """Start the turn, its reply bounded by num_predict and num_ctx once the prompt's length is known."""
    default = state.sampling_defaults.get("max_tokens")
    return await start_turn(request, state, llm, chat_request, id_prefix="ollama",
                            fields={**OPTION_FIELDS, "prompt": prompt_field},
                            budget=lambda prompt_len: reply_budget(opts, prompt_len, llm.max_model_len, default,
                                                                   prompt_field))


async def _start_raw(request: Request, state: ServerState, llm: AsyncLLM, prompt: str, opts: Options,
                     response_format: ResponseFormat | None) -> Turn:
    """A raw prompt, tokenized as it is (special tokens added as for /v1/completions) and run without a template:
    a turn with neither tools nor a reasoning split, read as any other."""
    fields = {**OPTION_FIELDS, "prompt": "prompt"}
    try:
        text, ids = await asyncio.to_thread(llm.encode_prompt, prompt)  # tokenizing grows with the prompt
    except PocketLLMError as e:
        raise from_engine_error(e, fields=fields) from None
    max_tokens = reply_budget(opts, len(ids), llm.max_model_len, state.sampling_defaults.get("max_tokens"), "prompt")
    params = sampling_params(SamplingRequest(response_format=response_format, **sampling_fields(opts)),
                             max_tokens=max_tokens, logprobs=None, fields=fields, defaults=state.sampling_defaults)
    fields["structured_outputs"] = "format"  # sampling_params named the chat request's field
    engine_prompt = PromptRequest(text=text, ids=ids, params=params, request_id=request_id(request, "ollama"))
    [stream] = await start_all(request, [engine_prompt], fields)
    return Turn(request, rid=engine_prompt.request_id, llm=llm, prompt=engine_prompt, stream=stream, fields=fields,
                tool_parser=None, parallel_tool_calls=False, forced=False)


# -- responses -----------------------------------------------------------------------------------------------------

class NDJSONResponse(EventStreamResponse):
    """Newline-delimited JSON (Ollama's streams), with the event stream's care for a client that leaves: the lines'
    generator is closed however the response ends, which aborts the engine request."""

    media_type = "application/x-ndjson"


@dataclass(slots=True)
class _Clock:
    """When a request arrived, its engine request was added, and its first output came (its prompt was read)."""

    started: float
    queued: float
    first: float

    def done(self, finish_reason: str, usage: TurnUsage) -> dict[str, Any]:
        """The fields of the last object: ``done``, why, and the counts and durations (nanoseconds). The model was
        loaded at start, so none of the time went to loading it."""
        end = time.monotonic()
        return {"done": True, "done_reason": "length" if finish_reason == "length" else "stop",
                "total_duration": _ns(end - self.started), "load_duration": 0,
                "prompt_eval_count": usage.prompt_tokens, "prompt_eval_duration": _ns(self.first - self.queued),
                "eval_count": usage.completion_tokens, "eval_duration": _ns(end - self.first)}


async def _lines(run: Turn, clock: _Clock, line_of: Callable[[Piece], msgspec.Struct | None],
                 last: Callable[[dict[str, Any]], msgspec.Struct]) -> AsyncGenerator[bytes, None]:
    """One object per piece with text or calls, then the last, with ``done`` true; or, if the engine fails once
    the stream started, Ollama's error object."""
    finish_reason, usage = "stop", TurnUsage(run.prompt_tokens, 0)
    try:
        async for piece in run.pieces():
            line = line_of(piece)
            if line is not None:
                yield _line(line)
            finish_reason = piece.finish_reason or finish_reason
            usage = piece.usage or usage
        yield _line(last(clock.done(finish_reason, usage)))
    except APIError as e:  # the 200 is sent: say it in the stream, as Ollama does
        yield _line(OllamaErrorBody(e.info.message))
    finally:
        await run.aclose()


def _chat_line(model: str, piece: Piece) -> ChatResponse | None:
    if not (piece.content or piece.reasoning or piece.calls):
        return None
    return ChatResponse(model=model, created_at=_now(), done=False,
                        message=_message_out(piece.content, piece.reasoning, piece.calls))


def _generate_line(model: str, piece: Piece) -> GenerateResponse | None:
    if not (piece.content or piece.reasoning):
        return None
    return GenerateResponse(model=model, created_at=_now(), done=False, response=piece.content,
                            thinking=piece.reasoning or None)


def _message_out(content: str, reasoning: str | None, calls: list[ToolCall]) -> ReplyMessage:
    """The assistant's message; beside calls, the whitespace around them is no content (Ollama's is empty)."""
    return ReplyMessage(role="assistant", content=content if content.strip() or not calls else "",
                        thinking=reasoning or None,
                        tool_calls=[ReplyToolCall(id=call.id, function=ReplyFunction(
                            index=i, name=call.name, arguments=json.loads(call.arguments)))
                            for i, call in enumerate(calls)] or None)


def _line(payload: msgspec.Struct) -> bytes:
    return msgspec.json.encode(payload) + b"\n"


def _now() -> str:
    return timestamp(time.time())


def _ns(seconds: float) -> int:
    return round(seconds * _NS)


# -- embeddings ----------------------------------------------------------------------------------------------------

def _embedding_inputs(llm: AsyncLLM, texts: list[str], context: int, truncate: bool,
                      field: str = "input") -> list[list[int]]:
    """Each input's token ids. Longer than the context: its first tokens, as Ollama keeps; or, without
    ``truncate``, refused, naming the request's ``field``. A text too long to tokenize whole is cut first, to what
    those tokens can span."""
    prompts = []
    for i, text in enumerate(texts):
        if truncate:
            ids = llm.encode_prompt(text[:context * llm.tokenizer.max_token_chars])[1][:context]
        else:
            ids = llm.encode_prompt(text)[1]
            if len(ids) > context:
                which = field if len(texts) == 1 else f"{field} {i}"
                raise invalid_request(f"input exceeds maximum context length: {which} has {len(ids)} tokens, the "
                                      f"context {context}", field)
        prompts.append(ids)
    return prompts

