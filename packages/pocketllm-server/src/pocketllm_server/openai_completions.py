"""POST /v1/completions, streaming and not, for one prompt or a batch of them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence

from starlette.requests import Request
from starlette.responses import Response

from pocketllm import AsyncLLM, PocketLLMError
from pocketllm_server.errors import APIError, ErrorBody, from_engine_error, invalid_request
from pocketllm_server.generation import (
    ABORTED,
    PromptRequest,
    aborted,
    check_stream_options,
    collect,
    request_id,
    resolve_max_tokens,
    sampling_params,
    start_all,
    usage_info,
)
from pocketllm_server.logprobs import TokenTexts, completion_logprobs
from pocketllm_server.protocol import Completion, CompletionChoice, CompletionRequest, UsageInfo, json_response
from pocketllm_server.state import EngineStream, read_model_request
from pocketllm_server.streaming import DONE, EventStreamResponse, merge, sse

# OpenAI's (and vLLM's) default for this endpoint; chat instead fills the context.
DEFAULT_MAX_TOKENS = 16


async def create_completion(request: Request) -> Response:
    state, req, llm = await read_model_request(request, CompletionRequest)
    _check_options(req)
    rid = request_id(request, "cmpl")
    try:
        prompts = await asyncio.to_thread(_prompts, req.prompt, llm)  # tokenizing grows with the prompt
    except PocketLLMError as e:
        raise from_engine_error(e) from None
    requests = []
    for i, (text, ids) in enumerate(prompts):
        max_tokens = resolve_max_tokens(req.max_tokens, state.sampling_defaults.get("max_tokens", DEFAULT_MAX_TOKENS),
                                        prompt_len=len(ids), max_model_len=llm.max_model_len, param="max_tokens",
                                        prompt_param="prompt")
        params = sampling_params(req, max_tokens=max_tokens, logprobs=req.logprobs, fields={},
                                 defaults=state.sampling_defaults)
        requests.append(PromptRequest(text=text, ids=ids, params=params,
                                      request_id=rid if len(prompts) == 1 else f"{rid}-{i}"))
    streams = await start_all(request, requests, {})  # the engine has checked every id from here on
    for prompt in requests:
        if prompt.text is None and req.echo:  # token ids shown as text, special tokens included: what ran
            prompt.text = llm.tokenizer.decode(prompt.ids, skip_special_tokens=False)
    text_of = TokenTexts(llm.tokenizer)
    created = int(time.time())

    if req.stream:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        chunks = _chunks(streams, requests, req, rid=rid, model=state.served_model_name, created=created,
                         include_usage=include_usage, text_of=text_of)
        return EventStreamResponse(chunks, headers={"X-Request-Id": rid},
                                   on_disconnect=state.metrics.client_disconnects.inc)

    outputs = await collect(request, streams, requests, {})
    choices = []
    for i, (prompt, output) in enumerate(zip(requests, outputs, strict=True)):
        echo = (prompt.text or "") if req.echo else ""
        for c in output.outputs:
            logprobs = None
            if req.logprobs is not None and c.logprobs is not None:
                logprobs = completion_logprobs(c.logprobs, text_of, 0)
            choices.append(CompletionChoice(index=i * req.n + c.index, text=echo + c.text, logprobs=logprobs,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    usage = usage_info(sum(o.usage.prompt_tokens for o in outputs), sum(o.usage.completion_tokens for o in outputs))
    return json_response(Completion(id=rid, created=created, model=state.served_model_name, choices=choices,
                                    usage=usage), headers={"X-Request-Id": rid})


def _check_options(req: CompletionRequest) -> None:
    check_stream_options(req)
    if req.suffix is not None:
        raise APIError(400, "suffix is not supported", param="suffix", code="unsupported_option")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of is not supported (it may only equal n)", param="best_of",
                       code="unsupported_option")
    if req.echo and req.logprobs is not None:
        # OpenAI then returns logprobs for the prompt tokens too, which the engine does not compute.
        raise APIError(400, "echo together with logprobs is not supported: prompt logprobs are not computed",
                       param="echo", code="unsupported_option")


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
        async for i, event in merge(streams):
            if event.finish_reason == ABORTED:
                yield sse(ErrorBody(aborted().info))
                yield DONE
                return
            index = i * req.n + event.index
            text = event.text
            if req.echo and index not in offsets:
                text = (requests[i].text or "") + text
            offset = offsets.setdefault(index, 0)
            logprobs = None
            if req.logprobs is not None and event.logprobs:
                logprobs = completion_logprobs(event.logprobs, text_of, offset)
                offsets[index] = offset + sum(len(t) for t in logprobs.tokens)
            if text or event.finish_reason is not None or logprobs is not None:
                yield chunk([CompletionChoice(index=index, text=text, logprobs=logprobs,
                                              finish_reason=event.finish_reason, stop_reason=event.stop_reason)])
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
