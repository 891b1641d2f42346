"""POST /v1/completions, streaming and not, for one prompt or a batch of them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pocketllm import AsyncLLM, PocketLLMError, RequestOutput, SampledLogprobs, SamplingParams
from pocketllm_server.app_state import read_model_request
from pocketllm_server.engine_stream import EngineStream
from pocketllm_server.errors import APIError, ErrorBody, from_engine_error, invalid_request
from pocketllm_server.generation import (
    ABORTED,
    SAMPLING_EXTRAS,
    PromptRequest,
    aborted,
    check_stream_options,
    check_unsupported,
    collect,
    request_id,
    resolve_max_tokens,
    sampling_params,
    start_all,
    usage_info,
)
from pocketllm_server.logprobs import TokenTexts, completion_logprobs, echoed_logprobs, vllm_prompt_logprobs
from pocketllm_server.protocol import (
    MAX_PROMPTS,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    PromptLogprob,
    UsageInfo,
    json_response,
)
from pocketllm_server.streaming import DONE, EventStreamResponse, merge, sse

# OpenAI's (and vLLM's) default for this endpoint; chat instead fills the context.
DEFAULT_MAX_TOKENS = 16


async def create_completion(request: Request) -> Response:
    state, req, llm = await read_model_request(request, CompletionRequest)
    _check_options(req)
    count = _count_prompts(req.prompt)
    # Before any tokenizing: a batch that cannot be taken now must cost next to nothing to refuse.
    state.check_queue(count * req.n, "prompt" if count > 1 else "n")
    rid = request_id(request, "cmpl")
    fields: dict[str, str] = {}
    try:  # off the event loop: tokenizing and each prompt's parameters grow with the batch
        requests = await asyncio.to_thread(_prompt_requests, req, llm, state.sampling_defaults, rid, fields)
    except PocketLLMError as e:
        raise from_engine_error(e) from None
    streams = await start_all(request, requests, fields)  # the engine has checked every id from here on
    text_of = TokenTexts(llm.tokenizer)
    created = int(time.time())

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        chunks = _chunks(streams, requests, req, rid=rid, model=state.served_model_name, created=created,
                         include_usage=include_usage, text_of=text_of)
        return EventStreamResponse(chunks, headers={"X-Request-Id": rid},
                                   on_disconnect=state.metrics.client_disconnects.inc)

    outputs = await collect(request, streams, requests, fields)
    # Off the event loop: choices, their logprobs' texts and the JSON grow with prompts times n.
    return await asyncio.to_thread(_response, req, requests, outputs, text_of, rid=rid, created=created,
                                   model=state.served_model_name)


def _response(req: CompletionRequest, requests: Sequence[PromptRequest], outputs: Sequence[RequestOutput],
              text_of: TokenTexts, *, rid: str, created: int, model: str) -> Response:
    choices = []
    for i, (prompt, output) in enumerate(zip(requests, outputs, strict=True)):
        echo = _echo(prompt, text_of) if req.echo else ""
        scored = _scored(req, prompt, output.prompt_logprobs, text_of)
        for c in output.outputs:
            logprobs = None
            if req.logprobs is not None:
                logprobs = _joined(scored, completion_logprobs(c.logprobs or [], text_of, len(echo)))
            choices.append(CompletionChoice(index=i * req.n + c.index, text=echo + c.text, logprobs=logprobs,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                            prompt_logprobs=_vllm_scored(req, output.prompt_logprobs, text_of)))
    usage = usage_info(sum(o.usage.prompt_tokens for o in outputs), sum(o.usage.completion_tokens for o in outputs))
    return json_response(Completion(id=rid, created=created, model=model, choices=choices, usage=usage),
                         headers={"X-Request-Id": rid})


def _scored(req: CompletionRequest, prompt: PromptRequest, entries: list[SampledLogprobs | None] | None,
            text_of: TokenTexts) -> CompletionLogprobs | None:
    """The echoed prompt's part of ``logprobs``, where echo and logprobs are both asked for."""
    if not req.echo or req.logprobs is None or entries is None:
        return None
    return echoed_logprobs(prompt.ids, entries, text_of, req.logprobs)


def _vllm_scored(req: CompletionRequest, entries: list[SampledLogprobs | None] | None,
                 text_of: TokenTexts) -> list[dict[str, PromptLogprob] | None] | None:
    if req.prompt_logprobs is None or entries is None:
        return None
    return vllm_prompt_logprobs(entries, text_of, req.prompt_logprobs)


def _joined(prompt: CompletionLogprobs | None, completion: CompletionLogprobs) -> CompletionLogprobs:
    if prompt is None:
        return completion
    return CompletionLogprobs(tokens=prompt.tokens + completion.tokens,
                              token_logprobs=prompt.token_logprobs + completion.token_logprobs,
                              top_logprobs=prompt.top_logprobs + completion.top_logprobs,
                              text_offset=prompt.text_offset + completion.text_offset)


def _echo(prompt: PromptRequest, text_of: TokenTexts) -> str:
    """The prompt as ``echo`` shows it: its text, or its token ids' text with special tokens: what ran."""
    if prompt.text is not None:
        return prompt.text
    return text_of.tokenizer.decode(prompt.ids, skip_special_tokens=False)


def _check_options(req: CompletionRequest) -> None:
    check_stream_options(req)
    check_unsupported(req, SAMPLING_EXTRAS)
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_option")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it may only equal n)", param="best_of",
                       code="unsupported_option")
    if req.max_tokens == 0 and not req.echo and req.prompt_logprobs is None:
        raise invalid_request("max_tokens 0 scores the prompt alone: it needs echo or prompt_logprobs", "max_tokens")


def _count_prompts(prompt: str | list[str | int | list[int]]) -> int:
    """How many prompts there are, told from the first item (``_prompts`` checks the rest); at most MAX_PROMPTS."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    if len(prompt) > MAX_PROMPTS:
        raise invalid_request(f"prompt has {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed", "prompt")
    return len(prompt)


def _prompt_requests(req: CompletionRequest, llm: AsyncLLM, defaults: dict[str, Any], rid: str,
                     fields: dict[str, str]) -> list[PromptRequest]:
    """Each prompt's tokens and parameters. The parameters differ only in the room left for a completion: they
    are built and checked once for each distinct ``max_tokens``, not once per prompt."""
    prompts = _prompts(req.prompt, llm)
    params_for: dict[int, SamplingParams] = {}
    requests = []
    for i, (text, ids) in enumerate(prompts):
        max_tokens = resolve_max_tokens(req.max_tokens, defaults.get("max_tokens", DEFAULT_MAX_TOKENS),
                                        prompt_len=len(ids), max_model_len=llm.max_model_len, param="max_tokens",
                                        prompt_param="prompt")
        params = params_for.get(max_tokens)
        if params is None:
            params = params_for[max_tokens] = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs,
                                                              fields=fields, defaults=defaults,
                                                              prompt_logprobs=_prompt_logprobs(req, max_tokens))
        requests.append(PromptRequest(text=text, ids=ids, params=params,
                                      request_id=rid if len(prompts) == 1 else f"{rid}-{i}"))
    return requests


def _prompt_logprobs(req: CompletionRequest, max_tokens: int) -> int | None:
    """The alternatives the engine scores the prompt with: for echo with logprobs (OpenAI's prompt logprobs) and for
    vLLM's prompt_logprobs; a request that only echoes (max_tokens 0) is scored too, as the engine's way to run
    a prompt without a reply."""
    wanted = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    if wanted:
        return max(wanted)
    return 0 if max_tokens == 0 else None


def _prompts(prompt: str | list[str | int | list[int]], llm: AsyncLLM) -> list[tuple[str | None, list[int]]]:
    """Each prompt as (text or None, token ids): a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [llm.encode_prompt(prompt)]
    if not prompt:
        raise invalid_request("prompt must not be an empty list", "prompt")
    token_ids = [p for p in prompt if isinstance(p, int)]
    texts = [p for p in prompt if isinstance(p, str)]
    id_lists = [p for p in prompt if isinstance(p, list)]
    if len(token_ids) == len(prompt):
        return [llm.encode_prompt(token_ids)]
    if len(texts) == len(prompt):
        return [llm.encode_prompt(text) for text in texts]
    if len(id_lists) == len(prompt):
        return [llm.encode_prompt(ids) for ids in id_lists]
    raise invalid_request("prompt must be a string, a list of strings, a list of token ids, or a list of token-id "
                          "lists, without mixing them", "prompt")


async def _chunks(streams: Sequence[EngineStream], requests: Sequence[PromptRequest], req: CompletionRequest, *,
                  rid: str, model: str, created: int, include_usage: bool,
                  text_of: TokenTexts) -> AsyncGenerator[bytes, None]:
    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> bytes:
        return sse(Completion(id=rid, created=created, model=model, choices=choices, usage=usage))

    offsets: dict[int, int] = {}  # per choice: where its next token's text starts, for text_offset
    prompt_tokens = completion_tokens = 0
    try:
        echoes = await asyncio.to_thread(lambda: [_echo(p, text_of) for p in requests]) if req.echo else []
        async for i, event in merge(streams):
            if event.finish_reason == ABORTED:
                yield sse(ErrorBody(aborted().info))
                yield DONE
                return
            index = i * req.n + event.index
            text, scored = event.text, None
            if index not in offsets:  # the choice's first event: the echo, and the prompt's logprobs
                offsets[index] = len(echoes[i]) if req.echo else 0
                text = (echoes[i] if req.echo else "") + text
                scored = _scored(req, requests[i], event.prompt_logprobs, text_of)
            logprobs = None
            if req.logprobs is not None and (event.logprobs or scored is not None):
                logprobs = _joined(scored, completion_logprobs(event.logprobs or [], text_of, offsets[index]))
                offsets[index] += sum(len(t) for t in logprobs.tokens[len(scored.tokens) if scored else 0:])
            prompt_logprobs = _vllm_scored(req, event.prompt_logprobs, text_of)
            if text or event.finish_reason is not None or logprobs is not None or prompt_logprobs is not None:
                yield chunk([CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=event.finish_reason, stop_reason=event.stop_reason,
                                              prompt_logprobs=prompt_logprobs)])
            if event.usage is not None:
                prompt_tokens += event.usage.prompt_tokens
                completion_tokens += event.usage.completion_tokens
        if include_usage:
            yield chunk([], usage_info(prompt_tokens, completion_tokens))
        yield DONE
    except PocketLLMError as e:  # the engine failed mid-stream: the 200 is sent, so say it in the stream
        yield sse(ErrorBody(from_engine_error(e).info))
        yield DONE
    finally:
        for stream in streams:
            await stream.aclose()
