"""POST /v1/chat/completions, streaming and not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pocketllm import PocketLLMError
from pocketllm_server.errors import APIError, ErrorBody, from_engine_error, invalid_request
from pocketllm_server.generation import (
    ABORTED,
    PromptRequest,
    aborted,
    check_stream_options,
    collect,
    request_id,
    resolve_max_tokens,
    sampling_params,
    start_all,
    usage_info,
)
from pocketllm_server.logprobs import TokenTexts, chat_logprobs
from pocketllm_server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    DeltaMessage,
    UsageInfo,
    json_response,
)
from pocketllm_server.reasoning import ReasoningSplitter, split_reply
from pocketllm_server.state import EngineStream, read_model_request
from pocketllm_server.streaming import DONE, EventStreamResponse, sse


async def create_chat_completion(request: Request) -> Response:
    state, req, llm = await read_model_request(request, ChatCompletionRequest)
    _check_options(req)
    try:  # off the event loop: rendering and tokenizing grow with the conversation
        _, prompt_ids = await asyncio.to_thread(
            llm.render_chat, [msgspec.to_builtins(m) for m in req.messages],
            add_generation_prompt=req.add_generation_prompt, tools=req.tools,
            chat_template_kwargs=req.chat_template_kwargs)
    except PocketLLMError as e:
        raise from_engine_error(e, fields={"prompt": "messages"}) from None

    budget_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    # Engine field names as this endpoint spells them, for error messages' ``param``.
    fields = {"max_tokens": budget_field, "prompt": "messages"}
    max_tokens = resolve_max_tokens(
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        state.sampling_defaults.get("max_tokens"), prompt_len=len(prompt_ids), max_model_len=llm.max_model_len,
        param=budget_field, prompt_param="messages")
    params = sampling_params(req, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                             fields=fields, defaults=state.sampling_defaults)
    rid = request_id(request, "chatcmpl")
    prompt = PromptRequest(text=None, ids=prompt_ids, params=params, request_id=rid)
    [stream] = await start_all(request, [prompt], fields)
    text_of = TokenTexts(llm.tokenizer)
    created = int(time.time())

    def decode(ids: Sequence[int]) -> str:
        return llm.tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens)

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        chunks = _chunks(stream, rid=rid, model=state.served_model_name, created=created, n=req.n,
                         logprobs=req.logprobs, include_usage=include_usage, text_of=text_of,
                         reasoning_parser=state.reasoning_parser, decode=decode)
        return EventStreamResponse(chunks, headers={"X-Request-Id": rid},
                                   on_disconnect=state.metrics.client_disconnects.inc)

    [output] = await collect(request, [stream], [prompt], fields)
    choices, reasoning_tokens = [], 0
    for c in output.outputs:
        message = AssistantMessage(content=c.text)
        if state.reasoning_parser is not None:
            reasoning, answer, tokens = split_reply(state.reasoning_parser, c.token_ids, decode, c.text)
            message = AssistantMessage(content=answer, reasoning_content=reasoning, reasoning=reasoning)
            reasoning_tokens += tokens
        choices.append(ChatChoice(
            index=c.index, message=message,
            logprobs=chat_logprobs(c.logprobs, text_of) if req.logprobs and c.logprobs is not None else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    usage = usage_info(output.usage.prompt_tokens, output.usage.completion_tokens,
                       reasoning_tokens if state.reasoning_parser is not None else None)
    return json_response(ChatCompletion(id=rid, created=created, model=state.served_model_name, choices=choices,
                                        usage=usage), headers={"X-Request-Id": rid})


def _check_options(req: ChatCompletionRequest) -> None:
    check_stream_options(req)
    if req.top_logprobs and not req.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
    # Tools are shown to the model through its chat template, but tool calls are not parsed out of its reply,
    # so a request that insists on a call cannot be honoured.
    if req.tool_choice is not None and req.tool_choice not in ("none", "auto"):
        raise APIError(400, "tool_choice must be 'none' or 'auto': tool calls are not parsed by this server",
                       param="tool_choice", code="unsupported_option")


async def _chunks(stream: EngineStream, *, rid: str, model: str, created: int, n: int, logprobs: bool,
                  include_usage: bool, text_of: TokenTexts, reasoning_parser: str | None,
                  decode: Callable[[Sequence[int]], str]) -> AsyncGenerator[bytes, None]:
    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage))

    splitters = [ReasoningSplitter(reasoning_parser) for _ in range(n)] if reasoning_parser else None
    # Reasoning tokens are counted as for a whole reply, once each choice has its tokens and text.
    replies: list[tuple[list[int], list[str]]] = [([], []) for _ in range(n)]

    def delta(index: int, text: str, finished: bool) -> DeltaMessage:
        if splitters is None:
            return DeltaMessage(content=text or None)
        reasoning, answer = splitters[index].feed(text)
        if finished:
            held_reasoning, held_answer = splitters[index].finish()
            reasoning, answer = reasoning + held_reasoning, answer + held_answer
        return DeltaMessage(content=answer or None, reasoning_content=reasoning or None, reasoning=reasoning or None)

    try:
        for index in range(n):
            yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for event in stream:
            if event.finish_reason == ABORTED:
                yield sse(ErrorBody(aborted().info))
                yield DONE
                return
            lp = chat_logprobs(event.logprobs, text_of) if logprobs and event.logprobs else None
            if splitters is not None:
                replies[event.index][0].extend(event.token_ids)
                replies[event.index][1].append(event.text)
            if event.text or event.finish_reason is not None or lp is not None:
                message = delta(event.index, event.text, event.finish_reason is not None)
                yield chunk([ChatChunkChoice(index=event.index, delta=message, logprobs=lp,
                                             finish_reason=event.finish_reason, stop_reason=event.stop_reason)])
            if event.usage is not None and include_usage:
                reasoning_tokens = None
                if reasoning_parser is not None:
                    reasoning_tokens = sum(split_reply(reasoning_parser, ids, decode, "".join(texts))[2]
                                           for ids, texts in replies)
                yield chunk([], usage_info(event.usage.prompt_tokens, event.usage.completion_tokens,
                                           reasoning_tokens))
        yield DONE
    except PocketLLMError as e:  # the engine failed mid-stream: the 200 is sent, so say it in the stream
        yield sse(ErrorBody(from_engine_error(e).info))
        yield DONE
    finally:
        await stream.aclose()
