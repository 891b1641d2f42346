"""OpenAI Responses API request, response and stream-event schemas (``/v1/responses``) as msgspec Structs.

``input`` items are decoded one at a time (``openai_responses``): the API has dozens of item types, and each one this
server does not take is refused by name rather than by a union's "no match".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from pocketllm.limits import INT64_MAX, INT64_MIN, MAX_LOGPROBS
from pocketllm_server.protocol import ChatTokenLogprob, SchemaName  # as chat's: logprobs, and a format's name

MAX_METADATA_KEYS = 16  # OpenAI's limits on metadata: 16 pairs, keys of 64 characters, values of 512
MAX_INPUT_ITEMS = 4096
"""Most items one request's ``input`` may hold: each becomes a message to render."""


# -- request -------------------------------------------------------------------------------------------------------

class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_schema", "json_object"]
    name: SchemaName | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None  # the grammar enforces the schema exactly either way


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    format: TextFormat | None = None
    # How long a reply the model should write: a local model has no such control; "low" and "high" are refused by
    # name (openai_responses), "medium" (the default) taken.
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True):
    # "none" turns the model's thinking off, any other effort on: a chat template's switch has two positions.
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # reasoning is given whole, not summarised
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name of summary


class FunctionTool(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A function tool, as the Responses API spells it (flat: no ``function`` wrapper)."""

    type: Literal["function"]
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    # Each tool is checked in openai_responses: built-in tools (web search, file search, ...) are refused by name.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    include: list[str] | None = None
    stream: bool = False
    metadata: Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
                        msgspec.Meta(max_length=MAX_METADATA_KEYS)] | None = None
    store: bool = True
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    background: bool | None = None
    user: str | None = None  # accepted for compatibility; not used
    # Settings of OpenAI's hosted service, accepted and checked: this server has no built-in tools for
    # max_tool_calls to bound (function calls are not counted by it), no service tiers, a prefix cache that needs
    # no routing key, no abuse tracking, and no obfuscation of stream events.
    max_tool_calls: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, bool] | None = None
    # Refused by name when given: they need OpenAI's hosted state (stored prompts, conversations).
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    # Extensions, as on /v1/chat/completions: the same seed gives the same reply.
    seed: Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: str | list[str] | None = None


# -- input items (decoded one by one) ------------------------------------------------------------------------------

class InputText(msgspec.Struct, kw_only=True, tag_field="type", tag="input_text"):
    text: str


class OutputTextIn(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str


class RefusalIn(msgspec.Struct, kw_only=True, tag_field="type", tag="refusal"):
    refusal: str


class InputImage(msgspec.Struct, kw_only=True, tag_field="type", tag="input_image"):
    pass


class InputFile(msgspec.Struct, kw_only=True, tag_field="type", tag="input_file"):
    pass


class InputAudio(msgspec.Struct, kw_only=True, tag_field="type", tag="input_audio"):
    pass


InputContent = InputText | OutputTextIn | RefusalIn | InputImage | InputFile | InputAudio


class MessageItem(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputContent]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None


class FunctionCallItem(msgspec.Struct, kw_only=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputContent]
    id: str | None = None
    status: str | None = None


class ReasoningTextIn(msgspec.Struct, kw_only=True):
    text: str
    type: str = "reasoning_text"


class ReasoningItemIn(msgspec.Struct, kw_only=True):
    type: Literal["reasoning"]
    summary: list[ReasoningTextIn] = msgspec.field(default_factory=list)
    content: list[ReasoningTextIn] | None = None
    id: str | None = None
    encrypted_content: str | None = None  # OpenAI's; this server writes none and reads none


# -- response ------------------------------------------------------------------------------------------------------

class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class OutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: str
    content: list[OutputText]
    role: str = "assistant"


class FunctionCallOut(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: str


class ReasoningOut(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)
    status: str = "completed"


OutputItem = OutputMessage | FunctionCallOut | ReasoningOut


class InputTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(msgspec.Struct, kw_only=True):
    reason: str


class ResponseErrorInfo(msgspec.Struct, kw_only=True):
    code: str
    message: str


class ReasoningEcho(msgspec.Struct, kw_only=True):
    effort: str | None = None
    summary: str | None = None


class ResponseObject(msgspec.Struct, kw_only=True, tag_field="object", tag="response"):
    id: str
    created_at: int
    model: str
    status: str  # in_progress, completed, incomplete, failed
    output: list[OutputItem]
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ReasoningEcho
    store: bool
    temperature: float | None
    top_p: float | None
    text: TextConfig
    tool_choice: str | dict[str, Any]
    tools: list[FunctionTool]
    metadata: dict[str, str]
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseErrorInfo | None = None
    truncation: str = "disabled"
    background: bool = False
    user: str | None = None


class DeletedResponse(msgspec.Struct, kw_only=True, tag_field="object", tag="response.deleted"):
    id: str
    deleted: bool = True


# -- stream events -------------------------------------------------------------------------------------------------

class Event(msgspec.Struct, kw_only=True, tag_field="type"):
    sequence_number: int


class ResponseCreated(Event, tag="response.created"):
    response: ResponseObject


class ResponseInProgress(Event, tag="response.in_progress"):
    response: ResponseObject


class ResponseCompleted(Event, tag="response.completed"):
    response: ResponseObject


class ResponseIncomplete(Event, tag="response.incomplete"):
    response: ResponseObject


class ResponseFailed(Event, tag="response.failed"):
    response: ResponseObject


class OutputItemAdded(Event, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(Event, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(Event, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class ContentPartDone(Event, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class OutputTextDelta(Event, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[ChatTokenLogprob] = msgspec.field(default_factory=list)


class OutputTextDone(Event, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[ChatTokenLogprob] = msgspec.field(default_factory=list)


class ReasoningTextDelta(Event, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(Event, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(Event, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(Event, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    arguments: str
    name: str


class ErrorEvent(Event, tag="error"):
    message: str
    code: str | None = None
    param: str | None = None
