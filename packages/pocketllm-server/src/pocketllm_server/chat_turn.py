"""One chat turn, whichever API asked for it.

Chat completions, Responses, Anthropic Messages and Ollama's chat all come here with the conversation as an OpenAI
chat request: one prompt builder, one set of sampling checks, the core's reasoning split, tool-call parsing and
forcing, structured outputs and usage. Each API only translates its request into a ``ChatCompletionRequest`` (with
``fields`` naming its own fields in errors) and the turn's replies or pieces into its own shapes.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from starlette.requests import Request

from pocketllm import AsyncLLM, PocketLLMError, SampledLogprobs, StreamEvent
from pocketllm.structured import StructuredOutputs
from pocketllm_server.app_state import ServerState
from pocketllm_server.engine_stream import EngineStream
from pocketllm_server.errors import APIError, from_engine_error, invalid_request
from pocketllm_server.generation import (
    ABORTED,
    CHAT_EXTRAS,
    PromptRequest,
    aborted,
    check_unsupported,
    collect,
    request_id,
    resolve_max_tokens,
    sampling_params,
    start_all,
)
from pocketllm_server.protocol import ChatCompletionRequest, ChatMessage
from pocketllm_server.tool_calls import ToolCall, ToolCallStream, forcing_grammar, parser_for_template
from pocketllm_server.tool_calls import parse as parse_tool_calls
from pocketllm_server.tool_schemas import check_tools

log = logging.getLogger("pocketllm_server")

THINKING_SWITCH = "enable_thinking"  # the chat-template variable of Qwen3's (and others') thinking switch


@dataclass(slots=True)
class TurnUsage:
    prompt_tokens: int
    completion_tokens: int
    reasoning_tokens: int | None = None


@dataclass(slots=True)
class Reply:
    """One choice of a finished turn. ``finish_reason`` is ``tool_calls`` where the reply ended in calls."""

    index: int
    content: str
    reasoning: str | None
    calls: list[ToolCall]
    finish_reason: str
    stop_reason: int | str | None
    logprobs: list[SampledLogprobs] | None


@dataclass(slots=True)
class Piece:
    """What one engine event adds to choice ``index``: reasoning and content text, then, on the last piece, the
    reply's tool calls and its finish; ``usage`` comes once, with the request's last event."""

    index: int
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[SampledLogprobs] | None = None
    usage: TurnUsage | None = None


class Turn:
    """A started turn: its engine request is running. Read it once, whole (``replies``) or as ``pieces``."""

    def __init__(self, request: Request, *, rid: str, llm: AsyncLLM, prompt: PromptRequest, stream: EngineStream,
                 fields: dict[str, str], tool_parser: str | None, parallel_tool_calls: bool, forced: bool) -> None:
        self.request = request
        self.rid = rid
        self.llm = llm
        self.prompt = prompt
        self.stream = stream
        self.fields = fields
        self.tool_parser = tool_parser
        self.parallel_tool_calls = parallel_tool_calls
        # A grammar forces the reply to be calls: what is left of one that was cut short (max_tokens) is the call
        # format's unfinished text, not content.
        self.forced = forced

    @property
    def n(self) -> int:
        return self.prompt.params.n

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt.ids)

    async def replies(self) -> tuple[list[Reply], TurnUsage]:
        """Every choice, whole, once the request ends (cancelled if the client leaves)."""
        [output] = await collect(self.request, [self.stream], [self.prompt], self.fields)
        replies = []
        for c in output.outputs:
            # With --reasoning-parser the core split the reply (SamplingParams.reasoning is set).
            answer = c.text if c.answer is None else c.answer
            calls: list[ToolCall] = []
            if self.tool_parser is not None:
                answer, calls = parse_tool_calls(self.tool_parser, answer)
                calls = calls if self.parallel_tool_calls else calls[:1]
                answer = "" if self.forced and not calls else answer
            replies.append(Reply(index=c.index, content=answer, reasoning=c.reasoning, calls=calls,
                                 finish_reason=_finish(c.finish_reason or "stop", bool(calls)),
                                 stop_reason=c.stop_reason, logprobs=c.logprobs))
        usage = output.usage
        return replies, TurnUsage(usage.prompt_tokens, usage.completion_tokens, usage.reasoning_tokens)

    async def pieces(self) -> AsyncGenerator[Piece, None]:
        """The choices' pieces as they come. A shutdown's abort or an engine failure is raised as an ``APIError``
        (the response has started: each API says it in its stream's own error event). Closes the stream."""
        tool_streams = [ToolCallStream(self.tool_parser) for _ in range(self.n)] if self.tool_parser else None
        try:
            async for event in self.stream:
                if event.finish_reason == ABORTED:
                    raise aborted()
                piece = self._piece(event, tool_streams)
                if piece.reasoning or piece.content or piece.finish_reason is not None or piece.logprobs \
                        or piece.usage is not None:
                    yield piece
        except PocketLLMError as e:
            raise from_engine_error(e, fields=self.fields) from None
        finally:
            await self.stream.aclose()

    def _piece(self, event: StreamEvent, tool_streams: list[ToolCallStream] | None) -> Piece:
        answer = event.text if event.answer is None else event.answer
        calls: list[ToolCall] = []
        if tool_streams is not None:
            answer = tool_streams[event.index].feed(answer)
            if event.finish_reason is not None:
                rest, calls = tool_streams[event.index].finish()
                answer += "" if self.forced and not calls else rest
                calls = calls if self.parallel_tool_calls else calls[:1]
        usage = None if event.usage is None else TurnUsage(event.usage.prompt_tokens, event.usage.completion_tokens,
                                                           event.usage.reasoning_tokens)
        return Piece(index=event.index, reasoning=event.reasoning or "", content=answer, calls=calls,
                     finish_reason=None if event.finish_reason is None else _finish(event.finish_reason, bool(calls)),
                     stop_reason=event.stop_reason, logprobs=event.logprobs or None, usage=usage)

    async def aclose(self) -> None:
        await self.stream.aclose()


def _finish(reason: str, called: bool) -> str:
    return "tool_calls" if called and reason == "stop" else reason


async def start_turn(request: Request, state: ServerState, llm: AsyncLLM, req: ChatCompletionRequest, *,
                     id_prefix: str, id_separator: str = "-", fields: dict[str, str] | None = None,
                     budget: Callable[[int], int] | None = None) -> Turn:
    """Render the conversation, check every parameter and start the engine request; its errors are raised here,
    before any response starts. ``fields`` names the request's own fields in errors, by chat completions' names
    (``messages``, ``max_tokens``, ``tool_choice``, ``response_format``, ...). ``budget``, given the prompt's
    length, says the reply's max_tokens where an API bounds it by the context (Ollama's num_ctx); else
    ``req.max_tokens`` or the model's default, within max_model_len."""
    names = {"prompt": "messages", "max_tokens": "max_tokens", "tool_choice": "tool_choice",
             "response_format": "response_format", "tool_parameters": "tools[{i}].function.parameters",
             **(fields or {})}
    check_options(req)
    tools, tool_choice = tools_of(req)
    if tools:
        await asyncio.to_thread(check_tools, tools, names["tool_parameters"])
    try:  # off the event loop: rendering and tokenizing grow with the conversation
        prompt_ids = await asyncio.to_thread(_render, llm, req, tools, tool_choice)
    except PocketLLMError as e:
        raise from_engine_error(e, fields={"prompt": names["prompt"]}) from None
    parser = _reply_parser(state.tool_call_parser or "auto", llm) if tools and tool_choice != "none" else None

    budget_field = "max_completion_tokens" if req.max_completion_tokens is not None else names["max_tokens"]
    # Engine field names as this request spells them, for error messages' ``param``.
    errors = {**names, "max_tokens": budget_field}
    max_tokens = budget(len(prompt_ids)) if budget is not None else resolve_max_tokens(
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        state.sampling_defaults.get("max_tokens"), prompt_len=len(prompt_ids), max_model_len=llm.max_model_len,
        param=budget_field, prompt_param=names["prompt"])
    params = sampling_params(req, max_tokens=max_tokens, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                             fields=errors, defaults=state.sampling_defaults)
    if "structured_outputs" in errors and errors["structured_outputs"] == "response_format":
        errors["structured_outputs"] = names["response_format"]
    # Forced calls need no parser flag: where the template shows no format of its own, they take the generic one.
    choice_field = names["tool_choice"] if req.functions is None else "function_call"
    forced = _forced_calls(req, tools, tool_choice, parser or "generic", choice_field, names["response_format"])
    tool_parser = parser or ("generic" if forced is not None else None)
    # Without parallel_tool_calls, a forced reply is exactly one call, as vLLM's; a free-form one may hold several.
    # A reply to the legacy functions has one function_call.
    parallel = req.functions is None and (req.parallel_tool_calls is True if forced is not None
                                          else req.parallel_tool_calls is not False)
    if forced is not None:
        errors["structured_outputs"] = choice_field
        params = msgspec.structs.replace(params, structured_outputs=forced)
    if req.stop_in_reasoning and state.reasoning_parser is None:
        raise APIError(400, "stop_in_reasoning needs the server started with --reasoning-parser",
                       param="stop_in_reasoning", code="unsupported_option")
    if state.reasoning_parser is not None:  # grammars and stop strings apply after the reasoning section
        params = msgspec.structs.replace(params, reasoning=state.reasoning_parser,
                                         stop_in_reasoning=req.stop_in_reasoning)
    rid = request_id(request, id_prefix, id_separator)
    prompt = PromptRequest(text=None, ids=prompt_ids, params=params, request_id=rid)
    [stream] = await start_all(request, [prompt], errors)
    return Turn(request, rid=rid, llm=llm, prompt=prompt, stream=stream, fields=errors, tool_parser=tool_parser,
                parallel_tool_calls=parallel, forced=forced is not None)


def thinking_kwargs(llm: AsyncLLM, state: ServerState, enabled: bool | None, param: str) -> dict[str, Any] | None:
    """The chat-template variables that turn the model's thinking on or off (None: the template's default).

    Where the template has a switch, it is set. Where it has none, the model does what it always does: thinking
    asked of a model that never thinks (no ``--reasoning-parser``), or refused by one that always does, is a 400
    naming ``param``, as Ollama answers ``think`` on a model without thinking."""
    if enabled is None:
        return None
    if THINKING_SWITCH in (llm.tokenizer.chat_template or ""):
        return {THINKING_SWITCH: enabled}
    always = state.reasoning_parser is not None
    if enabled != always:
        does = "always thinks (the server splits its reasoning)" if always else "does not think (the server was " \
            "started without --reasoning-parser)"
        raise APIError(400, f"{param}: this model's chat template has no thinking switch, and the model {does}",
                       param=param, code="unsupported_option")
    return None


def check_options(req: ChatCompletionRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise invalid_request("stream_options is only allowed when stream is true", "stream_options")
    if req.top_logprobs and not req.logprobs:
        raise invalid_request("top_logprobs requires logprobs to be true", "top_logprobs")
    check_unsupported(req, CHAT_EXTRAS)
    if req.modalities is not None and req.modalities != ["text"]:
        raise APIError(400, "modalities other than ['text'] are not supported", param="modalities",
                       code="unsupported_option")
    if req.functions is not None and req.tools is not None:
        raise invalid_request("give tools or the legacy functions, not both", "functions")
    if req.continue_final_message and req.add_generation_prompt:
        raise invalid_request("continue_final_message needs add_generation_prompt false: the reply continues the "
                              "last message, it does not start a new one", "continue_final_message")


def _render(llm: AsyncLLM, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
            tool_choice: str | dict[str, Any] | None) -> list[int]:
    """The prompt's tokens. Under tool_choice none, a template that does not render tools is not given them: the
    system message that stands in for it asks for calls."""
    if tools and tool_choice == "none" and not llm.chat_builder.renders_tools:
        tools = None
    return llm.render_chat(conversation(req.messages), add_generation_prompt=req.add_generation_prompt, tools=tools,
                           chat_template_kwargs=req.chat_template_kwargs,
                           continue_final_message=req.continue_final_message)[1]


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """A request's messages as chat templates take them, those in the legacy functions form too: an assistant
    message's ``function_call`` as its one tool call, and a ``function`` message (its result) as the ``tool``
    message that answers it, by the call's id (the legacy form has none: each is named after its place)."""
    out, call_id = [], None
    for i, message in enumerate(msgspec.to_builtins(m) for m in messages):
        call = message.pop("function_call", None)
        if call is not None and message.get("role") == "assistant":
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise invalid_request(f"messages[{i}].function_call needs a name and arguments",
                                      f"messages[{i}].function_call")
            if message.get("tool_calls"):
                raise invalid_request(f"messages[{i}] has both tool_calls and the legacy function_call: give one",
                                      f"messages[{i}].function_call")
            call_id = f"call_{i}"
            message["tool_calls"] = [{"id": call_id, "type": "function", "function": {
                "name": call["name"], "arguments": call.get("arguments", "")}}]
        elif call is not None:
            raise invalid_request(f"messages[{i}]: only an assistant message carries a function_call",
                                  f"messages[{i}].function_call")
        if message.get("role") == "function":
            message = {**message, "role": "tool", **({"tool_call_id": call_id} if call_id else {})}
            call_id = None  # a call is answered once
        out.append(message)
    return out


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
                  tool_choice: str | dict[str, Any] | None, parser: str, param: str,
                  format_param: str) -> StructuredOutputs | None:
    """tool_choice "required" or a named function: the grammar that makes the reply such a call, or None."""
    if tool_choice in (None, "none", "auto"):
        return None
    name = None
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function") if req.functions is None else tool_choice
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise invalid_request(f"{param} must be none, auto, required or name a function", param)
    elif tool_choice != "required":
        raise invalid_request(f"{param} must be none, auto, required or name a function, got {tool_choice!r}", param)
    if not tools:
        raise invalid_request(f"{param} {json.dumps(tool_choice)} needs tools", param)
    if req.response_format is not None and req.response_format.type != "text":
        raise invalid_request(f"{param} {json.dumps(tool_choice)} and {format_param} cannot both constrain the reply",
                              param)
    try:
        return StructuredOutputs(grammar=forcing_grammar(parser, tools, name, req.parallel_tool_calls is True))
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="unsupported_option") from None


def tools_of(req: ChatCompletionRequest) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any] | None]:
    """The request's tools and tool_choice, the legacy functions and function_call mapped onto them."""
    if req.functions is not None:
        return [{"type": "function", "function": f} for f in req.functions], req.function_call
    return req.tools, req.tool_choice
