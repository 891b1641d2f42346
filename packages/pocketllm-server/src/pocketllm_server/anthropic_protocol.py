"""Anthropic Messages API request and response schemas (``/v1/messages``) as msgspec Structs.

Content blocks are tagged by ``type``; a block type this server does not take (images, documents, server tools'
results) decodes, so that it can be refused by name.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec

from pocketllm.limits import INT64_MAX, INT64_MIN

MAX_STOP_SEQUENCES = 64
"""Most stop sequences one request may give: each is matched against every piece of the reply."""
MIN_THINKING_BUDGET = 1024
"""Anthropic's least ``thinking.budget_tokens``."""


# -- request content blocks ----------------------------------------------------------------------------------------

class TextBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    text: str
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here (the prefix cache)


class ToolUseBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_result"):
    tool_use_id: str
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


class ThinkingBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="redacted_thinking"):
    data: str


class ImageBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="image"):
    source: dict[str, Any] | None = None


class DocumentBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="document"):
    source: dict[str, Any] | None = None


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock | ImageBlock \
    | DocumentBlock


class Message(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(msgspec.Struct, kw_only=True):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    # "custom" (or absent) is a client tool; server tools (web_search_..., bash_..., ...) are refused by name.
    type: str | None = None
    cache_control: dict[str, Any] | None = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(msgspec.Struct, kw_only=True):
    # Every type but "disabled" turns the model's thinking on: a local model has no adaptive mode of its own.
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: Annotated[int, msgspec.Meta(ge=MIN_THINKING_BUDGET)] | None = None
    display: Literal["summarized", "omitted"] | None = None  # omitted: thinking blocks without their text


class JsonOutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    # One effort level is all a local model has: every level runs it the same (documented in docs/server.md).
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None  # structured outputs: the reply is JSON that follows the schema


class Metadata(msgspec.Struct, kw_only=True):
    user_id: str | None = None  # for the client's own records; not used


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], msgspec.Meta(max_length=MAX_STOP_SEQUENCES)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0, le=INT64_MAX)] | None = None  # 0: off
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    cache_control: dict[str, Any] | None = None  # prompt caching is automatic here (the prefix cache)
    # An extension (Anthropic's API has no seed): the same seed gives the same reply, as on /v1/chat/completions.
    seed: Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


# -- responses -----------------------------------------------------------------------------------------------------

class TextOut(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


class ThinkingOut(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str = ""  # Anthropic signs its thinking; a local model's has nothing to sign


class ToolUseOut(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


BlockOut = TextOut | ThinkingOut | ToolUseOut


class Usage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int


class MessageOut(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    model: str
    content: list[BlockOut]
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage
    role: str = "assistant"


class CountTokensResponse(msgspec.Struct, kw_only=True):
    input_tokens: int


class ModelInfo(msgspec.Struct, kw_only=True, tag_field="type", tag="model"):
    """The served model as Anthropic's Models API describes one (``GET /v1/models/{model_id}``)."""

    id: str
    display_name: str
    created_at: datetime  # Anthropic's is the model's release; here, when the server started serving it
    max_input_tokens: int | None
    lifecycle: str = "active"


class ModelInfoList(msgspec.Struct, kw_only=True):
    data: list[ModelInfo]
    has_more: bool
    first_id: str | None
    last_id: str | None


# -- stream events -------------------------------------------------------------------------------------------------

class MessageStart(msgspec.Struct, kw_only=True, tag_field="type", tag="message_start"):
    message: MessageOut


class ContentBlockStart(msgspec.Struct, kw_only=True, tag_field="type", tag="content_block_start"):
    index: int
    content_block: BlockOut


class TextDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJsonDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="content_block_delta"):
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStop(msgspec.Struct, kw_only=True, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(msgspec.Struct, kw_only=True):
    stop_reason: str | None
    stop_sequence: str | None


class OutputUsage(msgspec.Struct, kw_only=True):
    output_tokens: int


class MessageDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: OutputUsage


class MessageStop(msgspec.Struct, kw_only=True, tag_field="type", tag="message_stop"):
    pass
