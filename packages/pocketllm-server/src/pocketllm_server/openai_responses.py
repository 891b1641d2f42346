"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API, as a chat turn (``chat_turn``).

``input`` items become an OpenAI chat conversation (``instructions`` its system message, ``function_call`` items
an assistant's tool calls, ``function_call_output`` items tool messages, ``reasoning`` items the reasoning of the
assistant message after them), behind the stored conversation that ``previous_response_id`` names. The turn's
reply becomes output items (reasoning, message, function calls), or the Responses stream of events.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from pocketllm import SampledLogprobs
from pocketllm_server.app_state import ServerState, read_model_request, state_of
from pocketllm_server.chat_turn import Reply, Turn, TurnUsage, start_turn, thinking_kwargs
from pocketllm_server.errors import APIError, invalid_request
from pocketllm_server.logprobs import TokenTexts, chat_logprobs
from pocketllm_server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ChatTokenLogprob,
    JsonSchemaFormat,
    ResponseFormat,
    json_response,
)
from pocketllm_server.responses_protocol import (
    ContentPartAdded,
    ContentPartDone,
    DeletedResponse,
    ErrorEvent,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    FunctionCallOut,
    FunctionCallOutputItem,
    FunctionTool,
    IncompleteDetails,
    InputContent,
    InputText,
    InputTokensDetails,
    MessageItem,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputMessage,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTextIn,
    OutputTokensDetails,
    ReasoningEcho,
    ReasoningItemIn,
    ReasoningOut,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    RefusalIn,
    ResponseCompleted,
    ResponseCreated,
    ResponseErrorInfo,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
)
from pocketllm_server.streaming import EventStreamResponse, sse_event
from pocketllm_server.tool_calls import ToolCall

# The Responses API's names of the request's fields, by the chat request's.
_FIELDS = {"prompt": "input", "max_tokens": "max_output_tokens", "tool_choice": "tool_choice",
           "response_format": "text.format", "tool_parameters": "tools[{i}].parameters"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Asked for by clients that keep no state (store false); this server writes reasoning in the clear instead.
_INCLUDES = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content"})
_ITEM_TYPES: dict[str, type] = {"message": MessageItem, "function_call": FunctionCallItem,
                                "function_call_output": FunctionCallOutputItem, "reasoning": ReasoningItemIn}


@dataclass(slots=True)
class _Request:
    """What a response echoes of its request, and where its conversation continues from."""

    req: ResponsesRequest
    tools: list[FunctionTool]
    history: list[ChatMessage]  # the stored conversation, then this request's input


async def create_response(request: Request) -> Response:
    state, req, llm = await read_model_request(request, ResponsesRequest)
    _check_refused(req)
    history = _previous(state, req.previous_response_id) + _input_messages(req.input)
    tools = _tools(req.tools)
    instructions = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    logprobs = LOGPROBS_INCLUDE in (req.include or [])
    chat = ChatCompletionRequest(
        messages=instructions + history, max_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, top_k=req.top_k, min_p=req.min_p, seed=req.seed, stop=req.stop, stream=req.stream,
        tools=[{"type": "function", "function": _function(t)} for t in tools] or None,
        tool_choice=_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
        response_format=_response_format(req.text), logprobs=logprobs, top_logprobs=req.top_logprobs,
        chat_template_kwargs=thinking_kwargs(llm, state, _thinking(req), "reasoning.effort"))
    # The prompt is the instructions and the conversation: one too long for the context names the longer of them.
    conversation = sum(len(m.content) for m in history if isinstance(m.content, str))
    fields = {**_FIELDS, "prompt": "instructions" if len(req.instructions or "") > conversation else "input"}
    turn = await start_turn(request, state, llm, chat, id_prefix="resp", id_separator="_", fields=fields)
    asked = _Request(req, tools, history)
    text_of = TokenTexts(llm.tokenizer) if logprobs else None
    if req.stream:
        return EventStreamResponse(_events(turn, state, asked, text_of), headers={"X-Request-Id": turn.rid},
                                   on_disconnect=state.metrics.client_disconnects.inc)
    [reply], usage = await turn.replies()
    response = _response(turn.rid, state, asked, _output(reply, text_of), usage, reply.finish_reason)
    _store(state, asked, response, reply)
    return json_response(response, headers={"X-Request-Id": turn.rid})


async def get_response(request: Request) -> Response:
    stored = state_of(request).responses.get(request.path_params["response_id"])
    if stored is None:
        raise _not_found(request.path_params["response_id"])
    return json_response(stored.response)


async def delete_response(request: Request) -> Response:
    response_id = request.path_params["response_id"]
    if not state_of(request).responses.delete(response_id):
        raise _not_found(response_id)
    return json_response(DeletedResponse(id=response_id))


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param="response_id")


def _check_refused(req: ResponsesRequest) -> None:
    """What of the API this server does not have, refused by name (the rest of a request is never ignored)."""
    if req.background:
        raise _unsupported("background", "background responses are not supported: stream instead")
    for name in ("prompt", "conversation"):
        if getattr(req, name) is not None:
            raise _unsupported(name, f"{name} needs state kept by OpenAI; give the input (or previous_response_id)")
    if req.truncation == "auto":
        raise _unsupported("truncation", "truncation 'auto' is not supported: a conversation longer than the "
                                         "context is refused, not cut")
    for value in req.include or []:
        if value not in _INCLUDES:
            raise _unsupported("include", f"include {value!r} is not supported (only {sorted(_INCLUDES)})")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise _unsupported("text.verbosity", f"text.verbosity {req.text.verbosity!r} is not supported: a local model "
                                             "writes as it writes (medium)")
    if req.top_logprobs and LOGPROBS_INCLUDE not in (req.include or []):
        raise invalid_request(f"top_logprobs needs include [{LOGPROBS_INCLUDE!r}]", "top_logprobs")


def _unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_option")


def _previous(state: ServerState, response_id: str | None) -> list[ChatMessage]:
    if response_id is None:
        return []
    stored = state.responses.get(response_id)
    if stored is None:
        raise APIError(404, f"Previous response with id '{response_id}' not found.", param="previous_response_id",
                       code="previous_response_not_found")
    return list(stored.conversation)


def _thinking(req: ResponsesRequest) -> bool | None:
    if req.reasoning is None or req.reasoning.effort is None:
        return None
    return req.reasoning.effort != "none"


# -- input ---------------------------------------------------------------------------------------------------------

def _input_messages(value: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The input items as chat messages: consecutive function calls form one assistant turn, and reasoning goes
    with the assistant turn that follows it."""
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    out: list[ChatMessage] = []
    reasoning: list[str] = []
    for i, raw in enumerate(value):
        item = _item(raw, i)
        if isinstance(item, ReasoningItemIn):
            reasoning += [part.text for part in (item.content or item.summary)]
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and last.tool_calls is not None and not reasoning:
                last.tool_calls.append(call)
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call],
                                       reasoning_content="".join(reasoning) or None))
                reasoning = []
        elif isinstance(item, FunctionCallOutputItem):
            out.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                   content=_text(item.output, f"input[{i}].output")))
        else:
            message = ChatMessage(role=item.role, content=_text(item.content, f"input[{i}].content"))
            if item.role == "assistant" and reasoning:
                message.reasoning_content, reasoning = "".join(reasoning), []
            out.append(message)
    if not out:
        raise invalid_request("input must hold at least one message or function call output", "input")
    return out


def _item(raw: dict[str, Any], i: int) -> MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItemIn:
    kind = raw.get("type", "message")  # a message may leave its type out (OpenAI's "easy" input message)
    item_type = _ITEM_TYPES.get(kind) if isinstance(kind, str) else None
    if item_type is None:
        raise _unsupported(f"input[{i}].type", f"input[{i}]: items of type {kind!r} are not supported (only "
                                               f"{', '.join(_ITEM_TYPES)})")
    try:
        item: MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItemIn = msgspec.convert(
            raw, item_type)
    except msgspec.ValidationError as e:
        raise invalid_request(f"input[{i}]: {e}", f"input[{i}]") from None
    return item


def _text(content: str | list[InputContent], path: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for k, part in enumerate(content):
        if isinstance(part, InputText | OutputTextIn):
            parts.append(part.text)
        elif isinstance(part, RefusalIn):
            parts.append(part.refusal)
        else:
            kind = part.__struct_config__.tag
            raise _unsupported(f"{path}[{k}]", f"{path}[{k}]: {kind} is not supported (this server's models read "
                                               "text)")
    return "".join(parts)


def _tools(tools: list[dict[str, Any]] | None) -> list[FunctionTool]:
    out = []
    for i, tool in enumerate(tools or []):
        if tool.get("type") != "function":
            raise _unsupported(f"tools[{i}].type", f"tools[{i}]: tool type {tool.get('type')!r} is not supported "
                                                   "(built-in tools need OpenAI's services; give function tools)")
        try:
            out.append(msgspec.convert(tool, FunctionTool))
        except msgspec.ValidationError as e:
            raise invalid_request(f"tools[{i}]: {e}", f"tools[{i}]") from None
    return out


def _function(tool: FunctionTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name,
                                "parameters": tool.parameters or {"type": "object", "properties": {}}}
    if tool.description is not None:
        function["description"] = tool.description
    return function


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    """The Responses form (``{"type": "function", "name": ...}``) as chat's; hosted-tool choices are refused."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise _unsupported("tool_choice", "tool_choice must be none, auto, required or "
                                          "{'type': 'function', 'name': ...}")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = None if text is None else text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema is None:
        raise invalid_request("text.format json_schema needs a schema", "text.format.schema")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name=fmt.name, schema=fmt.schema))


# -- output --------------------------------------------------------------------------------------------------------

def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _output(reply: Reply, text_of: TokenTexts | None) -> list[OutputItem]:
    items: list[OutputItem] = []
    status = "incomplete" if reply.finish_reason == "length" else "completed"
    if reply.reasoning:
        items.append(ReasoningOut(id=_item_id("rs"), content=[ReasoningText(text=reply.reasoning)], status=status))
    if reply.content.strip() or not reply.calls:
        logprobs = _logprobs(reply.logprobs, text_of)
        items.append(OutputMessage(id=_item_id("msg"), status=status,
                                   content=[OutputText(text=reply.content, logprobs=logprobs)]))
    items += [_function_call(call, "completed") for call in reply.calls]
    return items


def _function_call(call: ToolCall, status: str, arguments: str | None = None) -> FunctionCallOut:
    return FunctionCallOut(id=f"fc_{call.id.removeprefix('call_')}", call_id=call.id, name=call.name,
                           arguments=call.arguments if arguments is None else arguments, status=status)


def _logprobs(entries: list[SampledLogprobs] | None, text_of: TokenTexts | None) -> list[ChatTokenLogprob]:
    if not entries or text_of is None:
        return []
    return chat_logprobs(entries, text_of).content


def _response(rid: str, state: ServerState, asked: _Request, output: list[OutputItem], usage: TurnUsage | None,
              finish_reason: str | None, error: APIError | None = None) -> ResponseObject:
    """The response object; ``finish_reason`` None: still in progress."""
    req = asked.req
    status = "failed" if error is not None else "in_progress" if finish_reason is None else \
        "incomplete" if finish_reason == "length" else "completed"
    return ResponseObject(
        id=rid, created_at=int(time.time()), model=state.served_model_name, status=status, output=output,
        instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls is not False, previous_response_id=req.previous_response_id,
        reasoning=ReasoningEcho(effort=None if req.reasoning is None else req.reasoning.effort,
                                summary=None if req.reasoning is None else req.reasoning.summary),
        store=req.store, temperature=req.temperature, top_p=req.top_p,
        text=req.text or TextConfig(format=None), tool_choice=req.tool_choice or "auto", tools=asked.tools,
        metadata=req.metadata or {}, user=req.user,
        usage=None if usage is None else ResponseUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
            total_tokens=usage.prompt_tokens + usage.completion_tokens, input_tokens_details=InputTokensDetails(),
            output_tokens_details=OutputTokensDetails(reasoning_tokens=usage.reasoning_tokens or 0)),
        incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
        error=None if error is None else ResponseErrorInfo(code=error.info.code or "server_error",
                                                           message=error.info.message))


def _store(state: ServerState, asked: _Request, response: ResponseObject, reply: Reply) -> None:
    if not asked.req.store:
        return
    calls = [{"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
             for call in reply.calls]
    answer = ChatMessage(role="assistant", content=reply.content, tool_calls=calls or None,
                         reasoning_content=reply.reasoning or None)
    state.responses.put(response, [*asked.history, answer])


# -- streaming -----------------------------------------------------------------------------------------------------

class _Items:
    """The output items of a streamed response: the one open (reasoning or message), its text so far, the
    finished ones, and each event's sequence number."""

    def __init__(self, text_of: TokenTexts | None) -> None:
        self.text_of = text_of
        self.sequence = 0
        self.done: list[OutputItem] = []
        self.open: ReasoningOut | OutputMessage | None = None
        self.text = ""
        self.logprobs: list[ChatTokenLogprob] = []

    def number(self) -> int:
        self.sequence += 1
        return self.sequence - 1

    def add(self, kind: str, text: str, logprobs: list[SampledLogprobs] | None) -> list[Any]:
        """Events for ``text`` of ``kind`` (reasoning or message): opening its item (closing another) first."""
        events = []
        if self.open is None or (kind == "reasoning") != isinstance(self.open, ReasoningOut):
            events += self.close("completed")
            self.open = ReasoningOut(id=_item_id("rs"), content=[], status="in_progress") if kind == "reasoning" \
                else OutputMessage(id=_item_id("msg"), status="in_progress", content=[])
            part = ReasoningText(text="") if kind == "reasoning" else OutputText(text="")
            events += [OutputItemAdded(sequence_number=self.number(), output_index=len(self.done), item=self.open),
                       ContentPartAdded(sequence_number=self.number(), item_id=self.open.id,
                                        output_index=len(self.done), content_index=0, part=part)]
        self.text += text
        where = {"item_id": self.open.id, "output_index": len(self.done), "content_index": 0}
        if kind == "reasoning":
            events.append(ReasoningTextDelta(sequence_number=self.number(), delta=text, **where))
        else:
            new = _logprobs(logprobs, self.text_of)
            self.logprobs += new
            events.append(OutputTextDelta(sequence_number=self.number(), delta=text, logprobs=new, **where))
        return events

    def close(self, status: str) -> list[Any]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item.id, "output_index": len(self.done), "content_index": 0}
        if isinstance(item, ReasoningOut):
            part: ReasoningText | OutputText = ReasoningText(text=self.text)
            item = ReasoningOut(id=item.id, content=[part], status=status)
            text_done: Any = ReasoningTextDone(sequence_number=self.number(), text=self.text, **where)
        else:
            part = OutputText(text=self.text, logprobs=self.logprobs)
            item = OutputMessage(id=item.id, status=status, content=[part])
            text_done = OutputTextDone(sequence_number=self.number(), text=self.text, logprobs=self.logprobs,
                                       **where)
        self.text, self.logprobs = "", []
        events = [text_done, ContentPartDone(sequence_number=self.number(), part=part, **where),
                  OutputItemDone(sequence_number=self.number(), output_index=len(self.done), item=item)]
        self.done.append(item)
        return events

    def call(self, call: ToolCall) -> list[Any]:
        index = len(self.done)
        item = _function_call(call, "completed")
        self.done.append(item)
        where = {"item_id": item.id, "output_index": index}
        return [OutputItemAdded(sequence_number=self.number(), output_index=index,
                                item=_function_call(call, "in_progress", arguments="")),
                FunctionCallArgumentsDelta(sequence_number=self.number(), delta=call.arguments, **where),
                FunctionCallArgumentsDone(sequence_number=self.number(), arguments=call.arguments, name=call.name,
                                          **where),
                OutputItemDone(sequence_number=self.number(), output_index=index, item=item)]


async def _events(turn: Turn, state: ServerState, asked: _Request,
                  text_of: TokenTexts | None) -> AsyncGenerator[bytes, None]:
    """The stream's frames (``_frames``); the engine request stops however the stream ends."""
    try:
        async for frame in _frames(turn, state, asked, text_of):
            yield frame
    finally:  # a client that left before the first piece: its request stops too
        await turn.aclose()


async def _frames(turn: Turn, state: ServerState, asked: _Request,
                  text_of: TokenTexts | None) -> AsyncGenerator[bytes, None]:
    """response.created and .in_progress; each item's added, deltas and done; then response.completed (or
    .incomplete), or an error event and response.failed if the engine fails once the stream started."""
    def event(payload: Any) -> bytes:
        return sse_event(payload.__struct_config__.tag, payload)

    items = _Items(text_of)
    started = _response(turn.rid, state, asked, [], None, None)
    yield event(ResponseCreated(sequence_number=items.number(), response=started))
    yield event(ResponseInProgress(sequence_number=items.number(), response=started))
    content, reasoning = [], []
    last = None  # the finishing piece
    usage: TurnUsage | None = None
    try:
        async for piece in turn.pieces():
            frames = []
            if piece.reasoning:
                reasoning.append(piece.reasoning)
                frames += items.add("reasoning", piece.reasoning, None)
            if piece.content or piece.logprobs:
                content.append(piece.content)
                frames += items.add("message", piece.content, piece.logprobs)
            if piece.finish_reason is not None:
                last = piece
                if not items.done and items.open is None and not piece.calls:
                    frames += items.add("message", "", None)  # an empty reply is still a message
                frames += items.close("incomplete" if piece.finish_reason == "length" else "completed")
                for call in piece.calls:
                    frames += items.call(call)
            usage = piece.usage or usage
            for frame in frames:
                yield event(frame)
    except APIError as e:
        yield event(ErrorEvent(sequence_number=items.number(), message=e.info.message, code=e.info.code,
                               param=e.info.param))
        failed = _response(turn.rid, state, asked, items.done, None, None, error=e)
        yield event(ResponseFailed(sequence_number=items.number(), response=failed))
        return
    assert last is not None and last.finish_reason is not None  # the engine ends every request with a finish
    final = _response(turn.rid, state, asked, items.done, usage, last.finish_reason)
    _store(state, asked, final, Reply(index=0, content="".join(content), reasoning="".join(reasoning) or None,
                                      calls=last.calls, finish_reason=last.finish_reason,
                                      stop_reason=last.stop_reason, logprobs=None))
    done = ResponseIncomplete if final.status == "incomplete" else ResponseCompleted
    yield event(done(sequence_number=items.number(), response=final))
