"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API, as a chat turn (``chat_turn``).

The request becomes an OpenAI chat request (system blocks a system message, ``tool_use`` blocks an assistant's
tool calls, ``tool_result`` blocks tool messages, ``thinking`` blocks the reasoning an assistant message carries);
the turn's reply becomes content blocks and a stop reason, or Anthropic's stream of events.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pocketllm import AsyncLLM, PocketLLMError
from pocketllm_server.anthropic_protocol import (
    BlockOut,
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    CountTokensRequest,
    CountTokensResponse,
    InputJsonDelta,
    Message,
    MessageDelta,
    MessageOut,
    MessagesRequest,
    MessageStart,
    MessageStop,
    OutputConfig,
    OutputUsage,
    RedactedThinkingBlock,
    StopDelta,
    TextBlock,
    TextDelta,
    TextOut,
    ThinkingBlock,
    ThinkingDelta,
    ThinkingOut,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    Usage,
)
from pocketllm_server.app_state import ServerState, read_model_request
from pocketllm_server.chat_turn import Turn, start_turn, thinking_kwargs
from pocketllm_server.errors import APIError, anthropic_error, from_engine_error, invalid_request
from pocketllm_server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    ResponseFormat,
    json_response,
)
from pocketllm_server.streaming import EventStreamResponse, sse_event
from pocketllm_server.tool_calls import ToolCall

# Anthropic's names of the request's fields, by the chat request's.
_FIELDS = {"prompt": "messages", "max_tokens": "max_tokens", "stop": "stop_sequences", "tool_choice": "tool_choice",
           "tool_parameters": "tools.{i}.input_schema"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


async def create_message(request: Request) -> Response:
    state, req, llm = await read_model_request(request, MessagesRequest)
    messages = _messages(req.system, req.messages)
    prefill = _prefilled(messages)
    chat = ChatCompletionRequest(
        messages=messages, add_generation_prompt=not prefill, continue_final_message=prefill,
        max_tokens=req.max_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, seed=req.seed, stop=req.stop_sequences, stream=req.stream,
        tools=_tools(req.tools), tool_choice=_tool_choice(req.tool_choice, req.tools),
        parallel_tool_calls=None if req.tool_choice is None else not req.tool_choice.disable_parallel_tool_use,
        response_format=_response_format(req.output_config), chat_template_kwargs=_thinking(llm, state, req))
    turn = await start_turn(request, state, llm, chat, id_prefix="msg", id_separator="_", fields=_FIELDS)
    omit_thinking = req.thinking is not None and req.thinking.display == "omitted"
    stop_sequences = req.stop_sequences or []
    if req.stream:
        return EventStreamResponse(_events(turn, state.served_model_name, stop_sequences, omit_thinking),
                                   headers={"X-Request-Id": turn.rid},
                                   on_disconnect=state.metrics.client_disconnects.inc)
    [reply], usage = await turn.replies()
    blocks: list[BlockOut] = []
    if reply.reasoning:
        blocks.append(ThinkingOut(thinking="" if omit_thinking else reply.reasoning))
    if reply.content and (reply.content.strip() or not reply.calls):
        blocks.append(TextOut(text=reply.content))
    blocks += [_tool_use(call) for call in reply.calls]
    stop_reason, stop_sequence = _stop(reply.finish_reason, reply.stop_reason, stop_sequences)
    return json_response(MessageOut(id=turn.rid, model=state.served_model_name, content=blocks,
                                    stop_reason=stop_reason, stop_sequence=stop_sequence,
                                    usage=Usage(input_tokens=usage.prompt_tokens,
                                                output_tokens=usage.completion_tokens)),
                         headers={"X-Request-Id": turn.rid})


async def count_tokens(request: Request) -> Response:
    state, req, llm = await read_model_request(request, CountTokensRequest)
    tools = _tools(req.tools)
    _tool_choice(req.tool_choice, req.tools)  # checked as /v1/messages checks it
    messages = _messages(req.system, req.messages)
    prefill = _prefilled(messages)
    kwargs = _thinking(llm, state, req)
    try:  # off the event loop: rendering and tokenizing grow with the conversation
        _, ids = await asyncio.to_thread(llm.render_chat, [msgspec.to_builtins(m) for m in messages], tools=tools,
                                         chat_template_kwargs=kwargs, add_generation_prompt=not prefill,
                                         continue_final_message=prefill)
    except PocketLLMError as e:
        raise from_engine_error(e, fields={"prompt": "messages"}) from None
    return json_response(CountTokensResponse(input_tokens=len(ids)))


def _prefilled(messages: list[ChatMessage]) -> bool:
    """Whether the conversation ends with the assistant's own words, which the reply then continues (Anthropic's
    prefill); a final assistant turn of tool calls alone is a turn like any other."""
    last = messages[-1]
    return last.role == "assistant" and bool(last.content) and not last.tool_calls


def _response_format(config: OutputConfig | None) -> ResponseFormat | None:
    if config is None or config.format is None:
        return None
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=config.format.schema))


def _thinking(llm: AsyncLLM, state: ServerState, req: MessagesRequest | CountTokensRequest) -> dict[str, Any] | None:
    thinking = req.thinking
    if thinking is None:
        return None
    if thinking.type == "enabled" and thinking.budget_tokens is None:
        raise invalid_request("thinking.budget_tokens: Field required", "thinking.budget_tokens")
    if isinstance(req, MessagesRequest) and thinking.budget_tokens is not None \
            and thinking.budget_tokens >= req.max_tokens:
        raise invalid_request("`max_tokens` must be greater than `thinking.budget_tokens`", "thinking.budget_tokens")
    return thinking_kwargs(llm, state, thinking.type != "disabled", "thinking")


def _messages(system: str | list[TextBlock] | None, messages: list[Message]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if system:
        out.append(ChatMessage(role="system", content=system if isinstance(system, str)
                               else "".join(block.text for block in system)))
    for i, message in enumerate(messages):
        if not message.content and not (message.role == "assistant" and i == len(messages) - 1):
            raise invalid_request(f"messages.{i}: all messages must have non-empty content except for the optional "
                                  "final assistant message", f"messages.{i}.content")
        if isinstance(message.content, str):
            out.append(ChatMessage(role=message.role, content=message.content))
        elif message.role == "assistant":
            out.append(_assistant(message.content, i))
        else:
            out += _user(message.content, i)
    return out


def _assistant(blocks: list[Any], i: int) -> ChatMessage:
    text, reasoning, calls = [], [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            reasoning.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif not isinstance(block, RedactedThinkingBlock):  # encrypted by Anthropic: nothing a local model can read
            raise _unsupported_block(block, f"messages.{i}.content.{j}", "an assistant message")
    return ChatMessage(role="assistant", content="".join(text), tool_calls=calls or None,
                       reasoning_content="".join(reasoning) or None)


def _user(blocks: list[Any], i: int) -> list[ChatMessage]:
    """A user message's blocks in order: tool results as tool messages, runs of text as user messages."""
    out: list[ChatMessage] = []
    text: list[str] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if text:
                out.append(ChatMessage(role="user", content="".join(text)))
                text = []
            out.append(ChatMessage(role="tool", tool_call_id=block.tool_use_id,
                                   content=_result_text(block, f"messages.{i}.content.{j}")))
        else:
            raise _unsupported_block(block, f"messages.{i}.content.{j}", "a user message")
    if text:
        out.append(ChatMessage(role="user", content="".join(text)))
    return out


def _result_text(block: ToolResultBlock, path: str) -> str:
    if block.content is None or isinstance(block.content, str):
        text = block.content or ""
    else:
        parts = []
        for k, part in enumerate(block.content):
            if not isinstance(part, TextBlock):
                raise _unsupported_block(part, f"{path}.content.{k}", "a tool result")
            parts.append(part.text)
        text = "".join(parts)
    # A template has no place for the flag: the model reads it in the text, as Anthropic's own models are told.
    return f"Error: {text}" if block.is_error else text


def _unsupported_block(block: object, path: str, where: str) -> APIError:
    kind = block.__struct_config__.tag  # its "type", as the client wrote it
    return APIError(400, f"{path}: {kind} blocks are not supported in {where} (this server's models read text)",
                    param=path, code="unsupported_option")


def _tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise APIError(400, f"tools.{i}: server tool {tool.type!r} is not supported (only client tools, with "
                                "input_schema)", param=f"tools.{i}.type", code="unsupported_option")
        if tool.input_schema is None:
            raise invalid_request(f"tools.{i}.input_schema: Field required", f"tools.{i}.input_schema")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: ToolChoice | None, tools: list[Tool] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.type in ("any", "tool") and not tools:
        raise invalid_request(f"tool_choice {choice.type!r} needs tools", "tool_choice")
    if choice.type == "tool":
        if choice.name is None:
            raise invalid_request("tool_choice.name: Field required when type is tool", "tool_choice.name")
        if not any(tool.name == choice.name for tool in tools or []):
            raise invalid_request(f"tool_choice names tool {choice.name!r}, which is not in tools", "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _tool_use(call: ToolCall) -> ToolUseOut:
    return ToolUseOut(id=f"toolu_{call.id.removeprefix('call_')}", name=call.name, input=json.loads(call.arguments))


def _stop(finish_reason: str | None, stop_reason: int | str | None,
          stop_sequences: list[str]) -> tuple[str | None, str | None]:
    """Anthropic's stop_reason and stop_sequence for the engine's finish."""
    if finish_reason in _STOP_REASONS:
        return _STOP_REASONS[finish_reason], None
    if isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    return "end_turn", None


async def _events(turn: Turn, model: str, stop_sequences: list[str],
                  omit_thinking: bool) -> AsyncGenerator[bytes, None]:
    """message_start, each content block's start, deltas and stop, message_delta with the stop reason and usage,
    message_stop; or, if the engine fails once the stream started, Anthropic's error event."""
    def event(payload: Any) -> bytes:
        return sse_event(payload.__struct_config__.tag, payload)

    start = MessageOut(id=turn.rid, model=model, content=[], stop_reason=None, stop_sequence=None,
                       usage=Usage(input_tokens=turn.prompt_tokens, output_tokens=0))
    blocks = _Blocks()
    try:
        yield event(MessageStart(message=start))
        async for piece in turn.pieces():
            if piece.reasoning:
                thinking = ThinkingDelta(thinking="" if omit_thinking else piece.reasoning)
                for frame in blocks.delta("thinking", thinking):
                    yield event(frame)
            if piece.content:
                for frame in blocks.delta("text", TextDelta(text=piece.content)):
                    yield event(frame)
            if piece.finish_reason is None:
                continue
            for frame in blocks.close():
                yield event(frame)
            for call in piece.calls:
                for frame in blocks.tool_use(_tool_use(call), call.arguments):
                    yield event(frame)
            stop_reason, stop_sequence = _stop(piece.finish_reason, piece.stop_reason, stop_sequences)
            output_tokens = piece.usage.completion_tokens if piece.usage is not None else 0
            yield event(MessageDelta(delta=StopDelta(stop_reason=stop_reason, stop_sequence=stop_sequence),
                                     usage=OutputUsage(output_tokens=output_tokens)))
        yield event(MessageStop())
    except APIError as e:
        yield sse_event("error", anthropic_error(e))
    finally:  # a client that left before the first piece: its request stops too
        await turn.aclose()


class _Blocks:
    """The content blocks of a streamed message: which is open, and the index of the next."""

    def __init__(self) -> None:
        self.open: str | None = None
        self.index = -1

    def delta(self, kind: str, delta: TextDelta | ThinkingDelta) -> list[Any]:
        frames = []
        if self.open != kind:
            frames += self.close()
            self.index += 1
            self.open = kind
            frames.append(ContentBlockStart(index=self.index, content_block=ThinkingOut(thinking="")
                                            if kind == "thinking" else TextOut(text="")))
        frames.append(ContentBlockDelta(index=self.index, delta=delta))
        return frames

    def close(self) -> list[Any]:
        if self.open is None:
            return []
        self.open = None
        return [ContentBlockStop(index=self.index)]

    def tool_use(self, block: ToolUseOut, arguments: str) -> list[Any]:
        self.index += 1
        return [ContentBlockStart(index=self.index, content_block=ToolUseOut(id=block.id, name=block.name, input={})),
                ContentBlockDelta(index=self.index, delta=InputJsonDelta(partial_json=arguments)),
                ContentBlockStop(index=self.index)]
