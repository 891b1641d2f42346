"""Ollama's API (``/api/*``) request and response schemas as msgspec Structs, with Ollama's field names.

The fields are those of Ollama 0.12.0 (the version ``/api/version`` reports). As in Ollama, ``stream`` is true
unless a request says otherwise, and empty strings mean "not given" (Ollama's Go client always sends ``system``,
``template`` and ``suffix``, empty). Unknown ``options`` are refused by name: Ollama only logs them, and a
sampling parameter that is silently dropped gives the client other output than it asked for.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated, Any

import msgspec

from pocketllm.limits import INT64_MAX, INT64_MIN, MAX_REPETITION_PENALTY, MIN_REPETITION_PENALTY

OLLAMA_VERSION = "0.12.0"
"""The Ollama release whose API (fields, defaults, shapes) this server speaks: what ``/api/version`` reports."""


def timestamp(seconds: float) -> str:
    """A time as Ollama's ``created_at`` and ``modified_at`` write it: RFC 3339 in UTC, to the microsecond."""
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


# Every integer a request gives fits the engine's 64-bit fields (Go's int, as Ollama decodes them).
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]

# keep_alive: how long Ollama keeps a model loaded after a request (a Go duration such as "5m", or seconds; negative:
# forever). This server loads its one model at start and keeps it until it stops, so a keep_alive Ollama could read
# (ollama_options.check_keep_alive) is accepted and has nothing to set.
KeepAlive = str | float | None


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Ollama's ``options`` (its Modelfile parameters). ``ollama_api`` maps the sampling ones onto the engine's
    parameters and refuses values of sampling methods the engine does not have."""

    # -1 (Ollama's "infinite") and -2 ("fill the context") both run until the context ends: this server does not
    # shift the context to go on past it.
    num_predict: Int64 | None = None
    num_ctx: Annotated[int, msgspec.Meta(ge=1, le=INT64_MAX)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    min_p: float | None = None
    seed: Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)] | None = None  # -1: a random seed
    stop: list[str] | None = None
    # Ollama's name for the engine's repetition_penalty: bounded here so that an error names Ollama's field.
    repeat_penalty: Annotated[float, msgspec.Meta(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # The repeat penalty's window: the engine's penalty covers the whole context (-1).
    repeat_last_n: Int64 | None = None
    # Sampling methods the engine does not have: only the values that turn them off are accepted.
    typical_p: float | None = None
    tfs_z: float | None = None
    mirostat: Int64 | None = None
    mirostat_tau: float | None = None  # only read by mirostat, which must be off
    mirostat_eta: float | None = None
    penalize_newline: bool | None = None
    # Options that take effect when Ollama loads a model (and num_keep, for its context shifting, which this
    # server does not do): here the model is loaded once, as the server's own flags say, so there is nothing
    # for them to change.
    num_keep: Int64 | None = None
    num_batch: Int64 | None = None
    num_gpu: Int64 | None = None
    main_gpu: Int64 | None = None
    num_thread: Int64 | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    f16_kv: bool | None = None
    logits_all: bool | None = None
    vocab_only: bool | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    embedding_only: bool | None = None


# -- requests ------------------------------------------------------------------------------------------------------

class ToolCallFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: dict[str, Any] = msgspec.field(default_factory=dict)
    index: int | None = None


class ToolCall(msgspec.Struct, kw_only=True):
    function: ToolCallFunction
    id: str | None = None


class Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | None = None
    thinking: str | None = None  # an earlier reply's reasoning
    images: list[str] | None = None  # refused when not empty: this server's models read text
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None  # on a tool message: the tool whose result it is
    tool_call_id: str | None = None


class ChatRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    messages: list[Message] = msgspec.field(default_factory=list)  # none: only "load" the model
    tools: list[dict[str, Any]] | None = None
    format: str | dict[str, Any] | None = None  # "json", or a JSON schema
    options: Options | None = None
    stream: bool = True
    think: bool | str | None = None  # Ollama's thinking levels ("high", ...) are gpt-oss's, and refused
    keep_alive: KeepAlive = None
    logprobs: bool = False  # newer than 0.12.0, and refused: read so that asking for them is not ignored


class GenerateRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None  # none or empty: only "load" the model
    system: str | None = None
    raw: bool = False  # true: the prompt is the model's input as it is, without the chat template
    format: str | dict[str, Any] | None = None
    options: Options | None = None
    stream: bool = True
    think: bool | str | None = None
    keep_alive: KeepAlive = None
    logprobs: bool = False
    # Refused when given: fill-in-the-middle, a template of Ollama's own (Go) syntax, images, and the deprecated
    # context of token ids from an earlier reply.
    suffix: str | None = None
    template: str | None = None
    images: list[str] | None = None
    context: list[int] | None = None


class EmbedRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    input: str | list[str] = ""  # empty: only "load" the model
    truncate: bool = True  # inputs longer than the context keep their first tokens; false: refused
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    options: Options | None = None
    keep_alive: KeepAlive = None


class EmbeddingsRequest(msgspec.Struct, kw_only=True):
    """The older ``/api/embeddings``: one prompt, one vector."""

    model: str | None = None
    prompt: str = ""  # empty: only "load" the model
    options: Options | None = None
    keep_alive: KeepAlive = None


class ShowRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    name: str | None = None  # the older spelling of ``model``
    verbose: bool = False  # Ollama's fills long arrays of model_info; this server's has none

    def __post_init__(self) -> None:
        # Either names the model; Go clients send the other one empty.
        self.model = self.model or self.name or None


# -- responses -----------------------------------------------------------------------------------------------------

class ReplyFunction(msgspec.Struct, kw_only=True):
    index: int
    name: str
    arguments: dict[str, Any]


class ReplyToolCall(msgspec.Struct, kw_only=True):
    id: str
    function: ReplyFunction


class ReplyMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str
    thinking: str | None = None
    tool_calls: list[ReplyToolCall] | None = None


class _Response(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What every line of a chat or generate stream says; the durations (nanoseconds) and counts come on the
    last line, with ``done`` true."""

    model: str
    created_at: str
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ChatResponse(_Response, kw_only=True, omit_defaults=True):
    message: ReplyMessage


class GenerateResponse(_Response, kw_only=True, omit_defaults=True):
    response: str
    thinking: str | None = None


class EmbedResponse(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    embeddings: list[list[float]]
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None


class EmbeddingsResponse(msgspec.Struct, kw_only=True):
    embedding: list[float]


class ModelDetails(msgspec.Struct, kw_only=True):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class ListedModel(msgspec.Struct, kw_only=True):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class ListResponse(msgspec.Struct, kw_only=True):
    models: list[ListedModel]


class RunningModel(msgspec.Struct, kw_only=True):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class ProcessResponse(msgspec.Struct, kw_only=True):
    models: list[RunningModel]


class ShowResponse(msgspec.Struct, kw_only=True):
    modelfile: str
    parameters: str
    template: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class VersionResponse(msgspec.Struct, kw_only=True):
    version: str
