"""What the chat and completions endpoints share: ids, sampling parameters, starting and collecting requests."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request

from pocketllm import ConfigError, PocketLLMError, RequestOutput, SamplingParams
from pocketllm.capability_checks import check_prompt_logprob_entries, prompt_logprob_entries
from pocketllm.client import OutputCollector
from pocketllm.limits import MAX_REQUEST_PROMPT_LOGPROB_ENTRIES
from pocketllm.structured import StructuredOutputs
from pocketllm_server.app_state import state_of
from pocketllm_server.engine_stream import EngineStream
from pocketllm_server.errors import APIError, from_engine_error, invalid_request, unavailable
from pocketllm_server.protocol import CompletionTokensDetails, SamplingRequest, UsageInfo
from pocketllm_server.streaming import all_or_nothing, cancel_on_disconnect

ABORTED = "abort"  # the core's finish reason for a cancelled request
# SamplingRequest fields handed to SamplingParams unchanged when the client sets them.
_PASSTHROUGH = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "seed")


@dataclass(slots=True)
class PromptRequest:
    """One engine request: a prompt (text kept for ``echo``), its parameters and its engine request id."""

    text: str | None
    ids: list[int]
    params: SamplingParams
    request_id: str


def request_id(request: Request, prefix: str, separator: str = "-") -> str:
    """A new id, unique on this server: the response's ``id`` and the key of its engine requests.

    Never the client's X-Request-Id: clients choose theirs independently, and two in flight at once (or one's
    ``x`` beside the ``x-1`` a batch derives from another's) would refuse each other. Theirs comes back in the
    X-Request-Id header (see ``middleware.ClientRequestIdMiddleware``), and log lines name both.
    """
    rid = request.state.request_id = f"{prefix}{separator}{uuid.uuid4().hex}"  # see middleware.describe
    return rid


def resolve_max_tokens(requested: int | None, default: int | None, *, prompt_len: int, max_model_len: int,
                       param: str, prompt_param: str) -> int:
    """The completion budget: what was asked for, else ``default``, else the rest of the context (as vLLM)."""
    room = max_model_len - prompt_len
    if room <= 0:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens, and the prompt has "
                            f"{prompt_len} tokens, which leaves no room for a completion.",
                       param=prompt_param, code="context_length_exceeded")
    if requested is None:
        return room if default is None else min(default, room)
    if requested > room:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} for the "
                            "completion). Please reduce the prompt or the completion length.",
                       param=param, code="context_length_exceeded")
    return requested


def sampling_params(req: SamplingRequest, *, max_tokens: int, logprobs: int | None, fields: dict[str, str],
                    defaults: dict[str, Any], prompt_logprobs: int | None = None) -> SamplingParams:
    """Build and validate the engine's parameters: the request's, else the model's recommended ``defaults``
    (see ``--generation-config``); ``fields`` names request fields in errors."""
    values = {name: defaults[name] for name in _PASSTHROUGH if name in defaults}
    values |= {name: getattr(req, name) for name in _PASSTHROUGH if getattr(req, name) is not None}
    constraint, field = structured_outputs(req)
    if field is not None:
        fields["structured_outputs"] = field  # the grammar compiles later: its errors name this field
    try:
        return SamplingParams(
            structured_outputs=constraint,
            n=req.n, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=[req.stop] if isinstance(req.stop, str) else list(req.stop or []),
            stop_token_ids=list(req.stop_token_ids or []), ignore_eos=req.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            logit_bias=_logit_bias(req.logit_bias), skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, **values)
    except ConfigError as e:
        raise from_engine_error(e, fields=fields) from None


def structured_outputs(req: SamplingRequest) -> tuple[StructuredOutputs | None, str | None]:
    """The one structured-output spec the request gives, and the field it came from."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema is None:
                raise invalid_request("response_format json_schema needs json_schema.schema", "response_format")
            given.append(("response_format", {"json": fmt.json_schema.schema}))
        else:
            raise invalid_request(f"response_format type must be text, json_object or json_schema, got "
                                  f"{fmt.type!r}", "response_format")
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            given.append((name, {key: getattr(req, name)}))
    if not given:
        return None, None
    if len(given) > 1:
        raise invalid_request(f"give one structured-output constraint, not {', '.join(n for n, _ in given)}",
                              given[1][0])
    field, spec = given[0]
    try:
        return msgspec.convert(spec, StructuredOutputs), field
    except msgspec.ValidationError as e:
        raise invalid_request(f"{field}: {e}", field) from None
    except ConfigError as e:
        raise invalid_request(f"{field}: {e}", field) from None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's string keys as token ids; the core checks them against the vocabulary."""
    result: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            result[int(key)] = value
        except ValueError:
            raise invalid_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
    return result


def check_stream_options(req: SamplingRequest) -> None:
    if req.stream_options is not None and not req.stream:
        raise invalid_request("stream_options is only allowed when stream is true", "stream_options")


# Request fields this server decodes only to refuse, each with the value that asks for nothing (absent, or the
# neutral value a client may send anyway): vLLM's sampling extras on both endpoints, and on chat OpenAI's features
# it lacks and vLLM's chat extras.
SAMPLING_EXTRAS: dict[str, object] = {
    "allowed_token_ids": None, "bad_words": None, "use_beam_search": False, "length_penalty": 1.0,
    "logits_processors": None, "return_tokens_as_token_ids": False, "truncate_prompt_tokens": None, "typical_p": 1.0}
CHAT_EXTRAS: dict[str, object] = {
    **SAMPLING_EXTRAS, "audio": None, "prediction": None, "web_search_options": None, "reasoning_effort": None,
    "chat_template": None, "echo": False, "prompt_logprobs": None}


def check_unsupported(req: SamplingRequest, neutral: dict[str, object]) -> None:
    """A 400 naming the first field of ``neutral`` that ``req`` asks for: accepted and dropped, it would change
    nothing."""
    for name, value in neutral.items():
        given = getattr(req, name)
        if given is not None and given != value:
            raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_option")


async def start_all(request: Request, prompts: Sequence[PromptRequest], fields: dict[str, str]) -> list[EngineStream]:
    """Start every engine request and wait for each one's first output, or close them all on any failure.

    Waiting for the first output is what lets a bad request be answered with a 400 before a
    streaming response has sent its 200 headers. The prompts are admitted together: each of their ``n``
    choices counts as one sequence against ``max_queue_len``.
    """
    state = state_of(request)
    too_many = fields.get("prompt", "prompt") if len(prompts) > 1 else "n"  # what a request too large names
    try:  # the core bounds each prompt's; a request's prompts together have a bound of their own
        check_prompt_logprob_entries(sum(prompt_logprob_entries(len(p.ids), p.params) for p in prompts),
                                     MAX_REQUEST_PROMPT_LOGPROB_ENTRIES, "request")
    except ConfigError as e:
        raise from_engine_error(e, fields=fields) from None
    llm = state.check_queue(sum(p.params.n for p in prompts), too_many)
    started: list[EngineStream | None] = [None] * len(prompts)

    async def start(i: int, prompt: PromptRequest) -> None:
        started[i] = await state.start(llm, prompt.ids, prompt.params, prompt.request_id)

    try:
        await cancel_on_disconnect(request.receive, all_or_nothing([start(i, p) for i, p in enumerate(prompts)]))
    except BaseException as e:
        for stream in started:
            if stream is not None:
                await stream.aclose()
        if isinstance(e, PocketLLMError):
            raise from_engine_error(e, fields=fields) from None
        raise
    return [stream for stream in started if stream is not None]


async def collect(request: Request, streams: Sequence[EngineStream], prompts: Sequence[PromptRequest],
                  fields: dict[str, str]) -> list[RequestOutput]:
    """Run every stream to its end (cancelled if the client leaves) and fold its events into an output."""

    async def run(stream: EngineStream, prompt: PromptRequest) -> RequestOutput:
        collector = OutputCollector(prompt.request_id, prompt.text, prompt.ids, prompt.params.n)
        async for event in stream:
            collector.add(event)
        return collector.output

    try:
        outputs = await cancel_on_disconnect(request.receive,
                                             all_or_nothing([run(s, p) for s, p in zip(streams, prompts, strict=True)]))
    except PocketLLMError as e:
        raise from_engine_error(e, fields=fields) from None
    finally:
        for stream in streams:
            await stream.aclose()
    if any(choice.finish_reason == ABORTED for output in outputs for choice in output.outputs):
        raise aborted()
    return outputs


def aborted() -> APIError:
    """Why a request whose client is still connected was aborted: only a shutdown does that. ("abort" is no
    OpenAI finish reason: clients get this error instead, as a 503 or as a stream's last event.)"""
    return unavailable("the request was aborted because the server is shutting down", "request_aborted")


def usage_info(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     completion_tokens_details=None if reasoning_tokens is None
                     else CompletionTokensDetails(reasoning_tokens=reasoning_tokens))
