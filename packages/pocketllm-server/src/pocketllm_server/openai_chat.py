"""POST /v1/chat/completions, streaming and not."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pocketllm import AsyncLLM, PocketLLMError, StreamEvent
from pocketllm.structured import StructuredOutputs
from pocketllm_server.app_state import read_model_request
from pocketllm_server.engine_stream import EngineStream
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
    FunctionCall,
    ToolCallOut,
    UsageInfo,
    json_response,
)
from pocketllm_server.streaming import DONE, EventStreamResponse, sse
from pocketllm_server.tool_calls import ToolCall, ToolCallStream, forcing_grammar, parser_for_template
from pocketllm_server.tool_calls import parse as parse_tool_calls

log = logging.getLogger("pocketllm_server")


async def create_chat_completion(request: Request) -> Response:
    state, req, llm = await read_model_request(request, ChatCompletionRequest)
    _check_options(req)
    tools, tool_choice = _tools_of(req)
    try:  # off the event loop: rendering and tokenizing grow with the conversation
        prompt_ids = await asyncio.to_thread(_render, llm, req, tools, tool_choice)
    except PocketLLMError as e:
        raise from_engine_error(e, fields={"prompt": "messages"}) from None
    parser = _reply_parser(state.tool_call_parser or "auto", llm) if tools and tool_choice != "none" else None

    budget_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    # Engine field names as this endpoint spells them, for error messages' ``param``.
    fields = {"max_tokens": budget_field, "prompt": "messages"}
    max_tokens = resolve_max_tokens(
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        state.sampling_defaults.get("max_tokens"), prompt_len=len(prompt_ids), max_model_len=llm.max_model_len,
        param=budget_field, prompt_param="messages")
    params = sampling_params(req, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                             fields=fields, defaults=state.sampling_defaults)
    # Forced calls need no parser flag: where the template shows no format of its own, they take the generic one.
    forced = _forced_calls(req, tools, tool_choice, parser or "generic")
    tool_parser = parser or ("generic" if forced is not None else None)
    # Without parallel_tool_calls, a forced reply is exactly one call, as vLLM's; a free-form one may hold several.
    parallel = req.parallel_tool_calls is True if forced is not None else req.parallel_tool_calls is not False
    if forced is not None:
        fields["structured_outputs"] = "tool_choice" if req.functions is None else "function_call"
        params = msgspec.structs.replace(params, structured_outputs=forced)
    if req.stop_in_reasoning and state.reasoning_parser is None:
        raise APIError(400, "stop_in_reasoning needs the server started with --reasoning-parser",
                       param="stop_in_reasoning", code="unsupported_option")
    if state.reasoning_parser is not None:  # grammars and stop strings apply after the reasoning section
        params = msgspec.structs.replace(params, reasoning=state.reasoning_parser,
                                         stop_in_reasoning=req.stop_in_reasoning)
    rid = request_id(request, "chatcmpl")
    prompt = PromptRequest(text=None, ids=prompt_ids, params=params, request_id=rid)
    [stream] = await start_all(request, [prompt], fields)
    text_of = TokenTexts(llm.tokenizer)
    created = int(time.time())

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        chunks = _chunks(stream, rid=rid, model=state.served_model_name, created=created, n=req.n,
                         logprobs=req.logprobs, include_usage=include_usage, text_of=text_of,
                         tool_parser=tool_parser,
                         parallel_tool_calls=parallel)
        return EventStreamResponse(chunks, headers={"X-Request-Id": rid},
                                   on_disconnect=state.metrics.client_disconnects.inc)

    [output] = await collect(request, [stream], [prompt], fields)
    choices = []
    for c in output.outputs:
        # With --reasoning-parser the core split the reply (SamplingParams.reasoning is set).
        reasoning, answer = c.reasoning, c.text if c.answer is None else c.answer
        calls: list[ToolCall] = []
        if tool_parser is not None:
            answer, calls = parse_tool_calls(tool_parser, answer)
            calls = calls if parallel else calls[:1]
        message = AssistantMessage(content=answer if answer.strip() or not calls else None, tool_calls=[
            ToolCallOut(id=call.id, type="function", function=FunctionCall(name=call.name, arguments=call.arguments))
            for call in calls], reasoning_content=reasoning, reasoning=reasoning)
        choices.append(ChatChoice(
            index=c.index, message=message,
            logprobs=chat_logprobs(c.logprobs, text_of) if req.logprobs and c.logprobs is not None else None,
            finish_reason="tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason,
            stop_reason=c.stop_reason))
    usage = usage_info(output.usage.prompt_tokens, output.usage.completion_tokens, output.usage.reasoning_tokens)
    return json_response(ChatCompletion(id=rid, created=created, model=state.served_model_name, choices=choices,
                                        usage=usage), headers={"X-Request-Id": rid})


def _check_options(req: ChatCompletionRequest) -> None:
    check_stream_options(req)
    if req.top_logprobs and not req.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
    for name in ("audio", "prediction", "web_search_options"):
        if getattr(req, name) is not None:
            raise APIError(400, f"{name} is not supported", param=name, code="unsupported_option")
    if req.modalities is not None and req.modalities != ["text"]:
        raise APIError(400, "modalities other than ['text'] are not supported", param="modalities",
                       code="unsupported_option")
    if req.functions is not None and req.tools is not None:
        raise invalid_request("give tools or the legacy functions, not both", "functions")


def _render(llm: AsyncLLM, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
            tool_choice: str | dict[str, Any] | None) -> list[int]:
    """The prompt's tokens. Under tool_choice none, a template that does not render tools is not given them: the
    system message that stands in for it asks for calls."""
    if tools and tool_choice == "none" and not llm.chat_builder.renders_tools:
        tools = None
    messages = [msgspec.to_builtins(m) for m in req.messages]
    return llm.render_chat(messages, add_generation_prompt=req.add_generation_prompt, tools=tools,
                           chat_template_kwargs=req.chat_template_kwargs)[1]


def _reply_parser(parser: str, llm: AsyncLLM) -> str | None:
    """The format tool calls in replies are parsed (and forced) in: --tool-call-parser's; else (auto, the default)
    the generic one where the chat template does not render tools (the system message that stands in for it asks
    for that one), else the one the template shows, if any. Called once the prompt is rendered (which probed the
    template)."""
    if parser != "auto":
        if parser != "generic" and not llm.chat_builder.renders_tools:
            _warn_format_mismatch(parser)
        return parser
    return "generic" if not llm.chat_builder.renders_tools else parser_for_template(llm.tokenizer.chat_template)


@functools.cache
def _warn_format_mismatch(parser: str) -> None:
    log.warning("--tool-call-parser %s: the chat template does not render tools, so they go in a system message "
                "that asks for calls in the generic format, which %s does not read (leave the flag out, or give "
                "generic)", parser, parser)


def _forced_calls(req: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
                  tool_choice: str | dict[str, Any] | None, parser: str) -> StructuredOutputs | None:
    """tool_choice "required" or a named function: the grammar that makes the reply such a call, or None."""
    if tool_choice in (None, "none", "auto"):
        return None
    param = "tool_choice" if req.functions is None else "function_call"
    name = None
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function") if req.functions is None else tool_choice
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise invalid_request(f"{param} must be none, auto, required or name a function", param)
    elif tool_choice != "required":
        raise invalid_request(f"{param} must be none, auto, required or name a function, got {tool_choice!r}", param)
    if not tools:
        raise invalid_request(f"{param} {tool_choice!r} needs tools", param)
    if req.response_format is not None and req.response_format.type != "text":
        raise invalid_request(f"{param} {tool_choice!r} and response_format cannot both constrain the reply", param)
    try:
        return StructuredOutputs(grammar=forcing_grammar(parser, tools, name, req.parallel_tool_calls is True))
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="unsupported_option") from None


def _tools_of(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None]:
    """The request's tools and tool_choice, the legacy functions and function_call mapped onto them."""
    if req.functions is not None:
        return [{"type": "function", "function": f} for f in req.functions], req.function_call
    return req.tools, req.tool_choice


async def _chunks(stream: EngineStream, *, rid: str, model: str, created: int, n: int, logprobs: bool,
                  include_usage: bool, text_of: TokenTexts, tool_parser: str | None,
                  parallel_tool_calls: bool) -> AsyncGenerator[bytes, None]:
    def chunk(choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> bytes:
        return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=choices, usage=usage))

    tool_streams = [ToolCallStream(tool_parser) for _ in range(n)] if tool_parser else None
    called = [False] * n

    def deltas(event: StreamEvent) -> list[DeltaMessage]:
        """This piece's delta, then, at the end of a reply with tool calls, each call's name and arguments. With
        --reasoning-parser the core split the piece (SamplingParams.reasoning is set)."""
        index, finished = event.index, event.finish_reason is not None
        reasoning, answer = event.reasoning or "", event.text if event.answer is None else event.answer
        calls: list[ToolCall] = []
        if tool_streams is not None:
            answer = tool_streams[index].feed(answer)
            if finished:
                rest, calls = tool_streams[index].finish()
                answer += rest
                calls = calls if parallel_tool_calls else calls[:1]
        out = [DeltaMessage(content=answer or None, reasoning_content=reasoning or None,
                            reasoning=reasoning or None)]
        for i, call in enumerate(calls):
            out.append(DeltaMessage(tool_calls=[ToolCallOut(index=i, id=call.id, type="function",
                                                            function=FunctionCall(name=call.name, arguments=""))]))
            out.append(DeltaMessage(tool_calls=[ToolCallOut(index=i, function=FunctionCall(arguments=call.arguments))]))
        called[index] = called[index] or bool(calls)
        return out

    try:
        for index in range(n):
            yield chunk([ChatChunkChoice(index=index, delta=DeltaMessage(role="assistant", content=""))])
        async for event in stream:
            if event.finish_reason == ABORTED:
                yield sse(ErrorBody(aborted().info))
                yield DONE
                return
            lp = chat_logprobs(event.logprobs, text_of) if logprobs and event.logprobs else None
            if event.text or event.finish_reason is not None or lp is not None:
                # The piece's text, then any calls' names and arguments; the finish goes with the last.
                messages = deltas(event)
                finish = ("tool_calls" if called[event.index] and event.finish_reason == "stop"
                          else event.finish_reason)
                for i, message in enumerate(messages):
                    final = i == len(messages) - 1
                    if not final and message == DeltaMessage():
                        continue
                    yield chunk([ChatChunkChoice(index=event.index, delta=message, logprobs=lp if i == 0 else None,
                                                 finish_reason=finish if final else None,
                                                 stop_reason=event.stop_reason if final else None)])
            if event.usage is not None and include_usage:
                yield chunk([], usage_info(event.usage.prompt_tokens, event.usage.completion_tokens,
                                           event.usage.reasoning_tokens))
        yield DONE
    except PocketLLMError as e:  # the engine failed mid-stream: the 200 is sent, so say it in the stream
        yield sse(ErrorBody(from_engine_error(e).info))
        yield DONE
    finally:
        await stream.aclose()
