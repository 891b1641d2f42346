"""POST /v1/chat/completions, streaming and not: a chat turn (``chat_turn``) in OpenAI's chat shapes.

A request that gives the legacy ``functions`` (not ``tools``) is answered in the legacy shape, as OpenAI answers it:
the reply's call is its message's ``function_call`` (``delta.function_call`` streamed), and a reply that ends in it
finishes with "function_call".
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from starlette.requests import Request
from starlette.responses import Response

from pocketllm_server.app_state import read_model_request
from pocketllm_server.chat_turn import Piece, Reply, Turn, TurnUsage, start_turn
from pocketllm_server.errors import APIError, ErrorBody, invalid_request
from pocketllm_server.generation import usage_info
from pocketllm_server.logprobs import TokenTexts, chat_logprobs
from pocketllm_server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    DeltaMessage,
    FunctionCall,
    ToolCallOut,
    UsageInfo,
    json_response,
)
from pocketllm_server.streaming import DONE, EventStreamResponse, sse


async def create_chat_completion(request: Request) -> Response:
    state, req, llm = await read_model_request(request, ChatCompletionRequest)
    _check_tool_results(req)
    turn = await start_turn(request, state, llm, req, id_prefix="chatcmpl")
    text_of = TokenTexts(llm.tokenizer)
    created = int(time.time())
    legacy = req.functions is not None
    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        chunks = _chunks(turn, model=state.served_model_name, created=created, logprobs=req.logprobs,
                         include_usage=include_usage, text_of=text_of, legacy=legacy)
        return EventStreamResponse(chunks, headers={"X-Request-Id": turn.rid},
                                   on_disconnect=state.metrics.client_disconnects.inc)

    replies, usage = await turn.replies()
    choices = [ChatChoice(
        index=r.index, message=_message(r, legacy),
        logprobs=chat_logprobs(r.logprobs, text_of) if req.logprobs and r.logprobs is not None else None,
        finish_reason=_finish(r.finish_reason, legacy), stop_reason=r.stop_reason) for r in replies]
    return json_response(ChatCompletion(id=turn.rid, created=created, model=state.served_model_name,
                                        choices=choices, usage=_usage(usage)), headers={"X-Request-Id": turn.rid})


def _check_tool_results(req: ChatCompletionRequest) -> None:
    """A tool message says which call it answers, as OpenAI requires (Ollama's, which do not, come by another
    route): templates that pair results with calls read the id."""
    for i, message in enumerate(req.messages):
        if message.role == "tool" and not message.tool_call_id:
            raise invalid_request(f"messages[{i}].tool_call_id is required: a message with role 'tool' answers the "
                                  "tool call of that id", f"messages[{i}].tool_call_id")


def _message(reply: Reply, legacy: bool) -> AssistantMessage:
    calls = [ToolCallOut(id=call.id, type="function", function=FunctionCall(name=call.name, arguments=call.arguments))
             for call in reply.calls]  # a legacy reply has one at most (start_turn keeps no more)
    return AssistantMessage(content=reply.content if reply.content.strip() or not calls else None,
                            tool_calls=[] if legacy else calls,
                            function_call=calls[0].function if legacy and calls else None,
                            reasoning_content=reply.reasoning, reasoning=reply.reasoning)


def _finish(reason: str | None, legacy: bool) -> str | None:
    return "function_call" if legacy and reason == "tool_calls" else reason


def _usage(usage: TurnUsage) -> UsageInfo:
    return usage_info(usage.prompt_tokens, usage.completion_tokens, usage.reasoning_tokens)


def _deltas(piece: Piece, legacy: bool) -> list[DeltaMessage]:
    """The piece's text, then, at the end of a reply with tool calls, each call's name and arguments."""
    out = [DeltaMessage(content=piece.content or None, reasoning_content=piece.reasoning or None,
                        reasoning=piece.reasoning or None)]
    for i, call in enumerate(piece.calls):
        name, arguments = FunctionCall(name=call.name, arguments=""), FunctionCall(arguments=call.arguments)
        if legacy:
            out += [DeltaMessage(function_call=name), DeltaMessage(function_call=arguments)]
        else:
            out += [DeltaMessage(tool_calls=[ToolCallOut(index=i, id=call.id, type="function", function=name)]),
                    DeltaMessage(tool_calls=[ToolCallOut(index=i, function=arguments)])]
    return out


async def _chunks(turn: Turn, *, model: str, created: int, logprobs: bool, include_usage: bool,
                  text_of: TokenTexts, legacy: bool) -> AsyncGenerator[bytes, None]:
    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        return sse(ChatCompletionChunk(id=turn.rid, created=created, model=model, choices=choices, usage=usage))

    try:
        for index in range(turn.n):
            yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for piece in turn.pieces():
            lp = chat_logprobs(piece.logprobs, text_of) if logprobs and piece.logprobs else None
            if piece.content or piece.reasoning or piece.finish_reason is not None or lp is not None:
                # The piece's text, then any calls' names and arguments; the finish goes with the last.
                messages = _deltas(piece, legacy)
                for i, message in enumerate(messages):
                    final = i == len(messages) - 1
                    if not final and message == DeltaMessage():
                        continue
                    yield chunk([ChatChunkChoice(index=piece.index, delta=message, logprobs=lp if i == 0 else None,
                                                 finish_reason=_finish(piece.finish_reason, legacy) if final
                                                 else None,
                                                 stop_reason=piece.stop_reason if final else None)])
            if piece.usage is not None and include_usage:
                yield chunk([], _usage(piece.usage))
        yield DONE
    except APIError as e:  # a shutdown or an engine failure mid-stream: the 200 is sent, so say it in the stream
        yield sse(ErrorBody(e.info))
        yield DONE
    finally:
        await turn.aclose()
