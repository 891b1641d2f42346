"""Ollama's request fields as the engine's: options (sampling, the context, the reply's budget), ``format``,
``think`` and messages; what the engine cannot honour is refused by name."""

from __future__ import annotations

import json
import re
from typing import Any

from pocketllm import AsyncLLM
from pocketllm_server.app_state import ServerState
from pocketllm_server.chat_turn import thinking_kwargs
from pocketllm_server.errors import APIError, invalid_request
from pocketllm_server.ollama_protocol import (
    OLLAMA_VERSION,
    GenerateRequest,
    KeepAlive,
    Message,
    Options,
)
from pocketllm_server.protocol import (
    ChatMessage,
    JsonSchemaFormat,
    ResponseFormat,
)

OPTION_FIELDS = {"max_tokens": "options.num_predict", "stop": "options.stop", "seed": "options.seed",
                  "temperature": "options.temperature", "top_p": "options.top_p", "top_k": "options.top_k",
                  "min_p": "options.min_p", "repetition_penalty": "options.repeat_penalty",
                  "presence_penalty": "options.presence_penalty", "frequency_penalty": "options.frequency_penalty",
                  "response_format": "format", "structured_outputs": "format", "tool_choice": "tools"}
# Sampling methods the engine does not have, and the value that turns each off in Ollama (the only one accepted).
_NEUTRAL_OPTIONS = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}
# The engine's repetition penalty covers the whole context: Ollama's repeat_last_n -1. Ollama's default window, 64,
# is accepted too, as clients send it unchanged with any repeat_penalty.
_REPEAT_WINDOWS = (-1, 64)
# A Go duration (time.ParseDuration): "0", or numbers with units ("300ms", "1.5h", "1h30m"), signed as a whole.
_GO_DURATION = re.compile(r"[-+]?(?:0|(?:(?:\d+(?:\.\d*)?|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+)", re.ASCII)
_DURATION_PART = re.compile(r"(\d*)(?:\.(\d*))?(ns|us|µs|μs|ms|s|m|h)", re.ASCII)
_UNIT_NS = {"ns": 1, "us": 10**3, "µs": 10**3, "μs": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9,
            "h": 3600 * 10**9}
_MAX_DURATION_NS = 2**63 - 1  # Go's time.Duration is an int64 of nanoseconds
_INT64_DIGITS = len(str(_MAX_DURATION_NS))


def checked_options(options: Options | None) -> Options:
    """The request's options, once those the engine cannot honour are refused (unknown names already were, by
    the decoder)."""
    opts = options or Options()
    for name, neutral in _NEUTRAL_OPTIONS.items():
        value = getattr(opts, name)
        if value is not None and value != neutral:
            raise unsupported(f"options.{name}", f"{name} {value} is not supported: this engine has no such "
                                                  f"sampling ({neutral}, which turns it off, is accepted)")
    if opts.penalize_newline is False:
        raise unsupported("options.penalize_newline", "penalize_newline false is not supported: the penalties "
                                                       "apply to every token, newlines included")
    if opts.repeat_penalty is not None and opts.repeat_last_n not in (None, *_REPEAT_WINDOWS):
        raise unsupported("options.repeat_last_n", f"repeat_last_n {opts.repeat_last_n} is not supported: the "
                                                    "repetition penalty covers the whole context (-1)")
    if opts.num_predict is not None and (opts.num_predict == 0 or opts.num_predict < -2):
        raise invalid_request("options.num_predict must be positive, -1 (until the context ends) or -2 (fill the "
                              f"context), got {opts.num_predict}", "options.num_predict")
    return opts


def check_keep_alive(keep_alive: KeepAlive) -> None:
    """Refuse a keep_alive Ollama could not read: it takes a number of seconds (negative: forever) or a Go duration
    string, and answers anything else 400 with Go's error."""
    if isinstance(keep_alive, str) and not _is_go_duration(keep_alive):
        raise invalid_request(f'keep_alive: time: invalid duration "{keep_alive}" (give seconds, negative to keep the '
                              'model loaded, or a duration such as "5m" or "1h30m")', "keep_alive")


def _is_go_duration(text: str) -> bool:
    """Whether Go's time.ParseDuration reads ``text``: its syntax, and at most an int64 of nanoseconds."""
    if not _GO_DURATION.fullmatch(text):
        return False
    nanoseconds = 0
    for whole, fraction, unit in _DURATION_PART.findall(text):
        # Digits past an int64's are an overflow in the whole part, and below a nanosecond in the fraction (and
        # Python refuses to read more than 4,300 digits as one int).
        whole, fraction = whole.lstrip("0"), fraction[:_INT64_DIGITS]
        if len(whole) > _INT64_DIGITS:
            return False
        scale = _UNIT_NS[unit]
        nanoseconds += int(whole or 0) * scale + int(fraction or 0) * scale // 10 ** len(fraction)
    return nanoseconds <= _MAX_DURATION_NS + text.startswith("-")  # the most negative int64 is one further from 0


def unsupported(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_option")


def sampling_fields(opts: Options) -> dict[str, Any]:
    """The chat request's sampling fields; what the options leave out takes the server's defaults (the model's
    recommended settings, see ``--generation-config``), as on every other route."""
    return {"temperature": opts.temperature, "top_p": opts.top_p, "top_k": opts.top_k, "min_p": opts.min_p,
            "seed": None if opts.seed == -1 else opts.seed,  # Ollama's -1: a random seed
            "stop": opts.stop, "repetition_penalty": opts.repeat_penalty,
            "presence_penalty": opts.presence_penalty, "frequency_penalty": opts.frequency_penalty}


def context_size(opts: Options, max_model_len: int) -> int:
    """The context that bounds prompt and reply: num_ctx, at most the server's max_model_len."""
    return max_model_len if opts.num_ctx is None else min(opts.num_ctx, max_model_len)


def reply_budget(opts: Options, prompt_len: int, max_model_len: int, default: int | None, prompt_field: str) -> int:
    """The reply's max_tokens: num_predict (negative: no bound of its own), else the model's recommended one, cut
    to what the context leaves after the prompt (where Ollama would shift the context and go on, this ends the
    reply with done_reason length)."""
    context = context_size(opts, max_model_len)
    room = context - prompt_len
    if room <= 0:
        raise APIError(400, f"the prompt has {prompt_len} tokens, which leaves no room for a reply in the context "
                            f"of {context} tokens (num_ctx, at most the server's max_model_len {max_model_len})",
                       param=prompt_field, code="context_length_exceeded")
    wanted = default if opts.num_predict is None else None if opts.num_predict < 0 else opts.num_predict
    return room if wanted is None else min(wanted, room)


def format_of(fmt: str | dict[str, Any] | None) -> ResponseFormat | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return ResponseFormat(type="json_object")
    if isinstance(fmt, dict):
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="format", schema=fmt))
    raise invalid_request(f'format must be "json" or a JSON schema object, got {fmt!r}', "format")


def thinking_switch(llm: AsyncLLM, state: ServerState, think: bool | str | None) -> dict[str, Any] | None:
    if isinstance(think, str):  # Ollama takes levels only for gpt-oss, and answers other models so
        raise unsupported("think", f'think value "{think}" is not supported for this model')
    return thinking_kwargs(llm, state, think, "think")


def chat_message(i: int, message: Message) -> ChatMessage:
    if message.images:
        raise unsupported(f"messages.{i}.images", f"messages.{i}.images: images are not supported (this server's "
                                                   "models read text)")
    calls = [{"type": "function", "function": {"name": call.function.name, "arguments": json.dumps(
        call.function.arguments, ensure_ascii=False)}, **({"id": call.id} if call.id else {})}
        for call in message.tool_calls or []]
    return ChatMessage(role=message.role.lower(), content=message.content or "", tool_calls=calls or None,
                       reasoning_content=message.thinking or None, name=message.tool_name or None,
                       tool_call_id=message.tool_call_id or None)


def check_logprobs(logprobs: bool) -> None:
    if logprobs:
        raise unsupported("logprobs", f"logprobs is not supported: this server speaks Ollama's API {OLLAMA_VERSION}, "
                                       "which has none")


def check_generate(req: GenerateRequest) -> None:
    check_logprobs(req.logprobs)
    for name in ("suffix", "template"):
        if getattr(req, name):
            raise unsupported(name, f"{name} is not supported")
    if req.images:
        raise unsupported("images", "images are not supported (this server's models read text)")
    if req.context:  # an earlier reply's tokens, which this server does not return
        raise unsupported("context", "context is not supported: send the conversation to /api/chat")
    if req.raw and req.system:
        raise invalid_request("raw mode does not support system", "system")
    if req.raw and req.think is not None:
        raise invalid_request("raw mode does not support think: a raw prompt is not templated", "think")


