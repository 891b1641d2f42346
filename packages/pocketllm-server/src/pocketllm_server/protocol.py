"""OpenAI (and vLLM-extension) request and response schemas as msgspec Structs.

Requests are decoded straight into these types, so a wrong type or an out-of-range
value is rejected with msgspec's message and the JSON path of the field. Unknown
fields are ignored, as clients send fields this server has no use for.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from starlette.responses import Response

from pocketllm.limits import INT64_MAX, INT64_MIN, MAX_LOGPROBS, MAX_N
from pocketllm_server.errors import invalid_request

T = TypeVar("T")

MAX_PROMPTS = 2048
"""Most prompts one completions request, or inputs one embeddings request, may carry (OpenAI's limit on
embeddings' inputs): each becomes an engine request."""
MAX_LOGIT_BIAS_TOKENS = 1024
"""Most tokens one ``logit_bias`` may name (OpenAI allows 300): every engine request checks them all, and a
vocabulary's worth (150,000) took a third of a second per request on the event loop."""


# -- requests ------------------------------------------------------------------------------------------------------

class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


# A structured output's schema name, as OpenAI allows one.
SchemaName = Annotated[str, msgspec.Meta(pattern="^[a-zA-Z0-9_-]{1,64}$")]


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    name: SchemaName | None = None
    description: str | None = None
    schema: dict[str, Any] | bool | None = None
    strict: bool | None = None  # the grammar enforces the schema exactly either way


class ResponseFormat(msgspec.Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(msgspec.Struct, kw_only=True):
    """Fields both generation endpoints share; None means "not given" (defaults are applied later)."""

    model: str | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=MAX_N)] = 1
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: Annotated[dict[str, float], msgspec.Meta(max_length=MAX_LOGIT_BIAS_TOKENS)] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, msgspec.Meta(ge=0)] = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted for compatibility; not used
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's sampling extras this server does not have: decoded so that asking for one is refused by name
    # (generation.check_unsupported), where an unknown field would be dropped without a word.
    allowed_token_ids: Any = None
    bad_words: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    logits_processors: Any = None
    return_tokens_as_token_ids: Any = None
    truncate_prompt_tokens: Any = None
    typical_p: Any = None


# omit_defaults: messages go to the chat template as dicts, and templates test keys with ``is defined``.
class ContentPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    type: str
    text: str | None = None

    def __post_init__(self) -> None:
        # Other types are refused when the conversation is rendered: only text parts are read.
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs its `text` field")


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None  # an earlier reply's call in the legacy form (see chat_turn)
    reasoning_content: str | None = None  # an earlier reply's reasoning, for templates that show it


class ChatCompletionRequest(SamplingRequest, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    # Absent: free-form replies may hold several calls (OpenAI's default); a forced reply is one call (vLLM's).
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None  # the legacy form of tools
    function_call: str | dict[str, Any] | None = None  # the legacy form of tool_choice
    # OpenAI features this server does not have: refused when asked for (see chat_turn.check_options).
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    reasoning_effort: Any = None
    # vLLM's chat extras this server does not have (refused when asked for, as above).
    chat_template: Any = None
    echo: Any = None
    prompt_logprobs: Any = None
    add_generation_prompt: bool = True
    # vLLM's: the reply continues the last (assistant) message, as Anthropic's prefill does; no generation prompt.
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    stop_in_reasoning: bool = False  # with --reasoning-parser: stop strings also end the reasoning section


class CompletionRequest(SamplingRequest, kw_only=True):
    # Token ids and lists of prompts are told apart after decoding: msgspec unions allow one array type only.
    prompt: str | list[str | int | list[int]]
    # 0: score the prompt alone (with echo and logprobs, or prompt_logprobs), as evaluation harnesses do.
    max_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
    echo: bool = False
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's: each choice's prompt_logprobs, the prompt tokens' logprobs with this many alternatives.
    prompt_logprobs: Annotated[int, msgspec.Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: int | None = None


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[str | int | list[int]]  # told apart after decoding, as CompletionRequest.prompt
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    user: str | None = None  # accepted for compatibility; not used
    # vLLM's extensions: keep only the last N tokens of each input; skip the L2 normalization.
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    normalize: bool = True


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: either ``prompt`` or ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds BOS)
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# -- responses -----------------------------------------------------------------------------------------------------

class Embedding(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32s
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(msgspec.Struct, kw_only=True):
    id: str
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
    object: str = "list"


class CompletionTokensDetails(msgspec.Struct, kw_only=True):
    reasoning_tokens: int


class UsageInfo(msgspec.Struct, kw_only=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]


class FunctionCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str | None = None
    type: str | None = None
    function: FunctionCall
    index: int | None = None  # in streamed deltas


class AssistantMessage(msgspec.Struct, kw_only=True):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] = msgspec.field(default_factory=list)
    function_call: FunctionCall | None = None  # the reply's call, where the request gave the legacy functions
    # --reasoning-parser: the <think> section, under both names clients read (vLLM's and the newer one).
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM extension: the stop string or token id that matched


class ChatCompletion(msgspec.Struct, kw_only=True, tag_field="object", tag="chat.completion"):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallOut] | None = None
    function_call: FunctionCall | None = None


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


# omit_defaults drops ``usage`` from every chunk but the usage chunk; the tag (``object``) is always written.
class ChatCompletionChunk(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="object",
                          tag="chat.completion.chunk"):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    # With echo, the prompt's tokens first: the first one's logprob and alternatives are null (nothing precedes it).
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(msgspec.Struct, kw_only=True):
    """vLLM's ``prompt_logprobs`` entry: one token (the prompt's own, then its alternatives) at a position."""

    logprob: float
    rank: int | None
    decoded_token: str


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    # With the request's prompt_logprobs: per prompt token (null for the first), token id -> its logprob.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Completion(msgspec.Struct, kw_only=True, omit_defaults=True, tag_field="object", tag="text_completion"):
    """A whole completion, or (with ``usage`` left out until the last one) one streamed chunk of it."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(msgspec.Struct, kw_only=True, tag_field="object", tag="model"):
    id: str
    created: int
    owned_by: str
    root: str
    max_model_len: int | None


class ModelList(msgspec.Struct, kw_only=True, tag_field="object", tag="list"):
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


class TokenizerInfo(msgspec.Struct, kw_only=True):
    """vLLM's GET /tokenizer_info: what a client needs to tokenize through /tokenize and /detokenize."""

    eos_token: str | None
    bos_token: str | None
    chat_template: str | None
    model_max_length: int
    vocab_size: int
    pad_token: str | None = None  # the engine pads nothing


class HealthResponse(msgspec.Struct, kw_only=True):
    status: str  # "ok", "loading", "failed" (the model did not load) or "dead" (the engine loop stopped)
    model: str
    backend: str | None
    engine_alive: bool
    num_requests_running: int
    num_requests_waiting: int
    error: str | None = None


# -- decoding ------------------------------------------------------------------------------------------------------

_AT_PATH = re.compile(r" - at (?:`key` in )?`\$\.?(?P<path>[^`]*)`$")  # a bad key names its object
_MISSING = re.compile(r"missing required field `(?P<field>[^`]+)`")


MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a request body may have (tool schemas need a few levels, not 1,000)."""
_STRUCTURE = re.compile(rb'[\[\]{}"\\]')
# JSON's escapes, each matched from its backslash: a UTF-16 surrogate pair, half of one, or any other escape.
_ESCAPE = re.compile(rb"\\(?:u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}"
                     rb"|(?P<half>u[dD][89a-fA-F][0-9a-fA-F]{2})|.)", re.DOTALL)


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether arrays and objects in ``body`` nest deeper than ``limit``, brackets inside strings aside."""
    depth, in_string, skip_to = 0, False, -1
    for match in _STRUCTURE.finditer(body):
        position, char = match.start(), match.group()
        if position < skip_to:
            continue  # the character after a backslash
        if in_string:
            if char == b"\\":
                skip_to = position + 2
            elif char == b'"':
                in_string = False
        elif char == b'"':
            in_string = True
        elif char in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif char in (b"]", b"}"):
            depth -= 1
    return False


def decode(body: bytes, type_: type[T]) -> T:
    """Decode a JSON request body; a malformed or mistyped one becomes a 400 naming the field."""
    if json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise invalid_request(f"request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels")
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        message = str(e)
        at = _AT_PATH.search(message)
        path = at.group("path").replace("[...]", "") if at else ""  # msgspec's spelling of "some dict key"
        missing = _MISSING.search(message)
        if missing:
            path = f"{path}.{missing.group('field')}" if path else missing.group("field")
        raise invalid_request(message, path or None) from None
    except msgspec.DecodeError as e:
        # msgspec takes a lone high surrogate for the body being cut short: say what is wrong instead.
        # Only where msgspec's error is about that (another error earlier in the body is reported as it is).
        about_it = "truncated" in str(e) or "surrogate" in str(e)
        lone = next((m for m in _ESCAPE.finditer(body) if m.group("half")), None) if about_it else None
        reason = e if lone is None else f"invalid unicode escape {lone.group().decode()} at byte {lone.start()}: " \
            "half of a UTF-16 surrogate pair, which is no character"
        raise invalid_request(f"request body is not valid JSON: {reason}") from None


def json_response(payload: object, *, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(msgspec.json.encode(payload), status_code=status, headers=headers, media_type="application/json")
