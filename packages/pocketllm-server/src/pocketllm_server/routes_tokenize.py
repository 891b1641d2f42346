"""vLLM's POST /tokenize and /detokenize, and GET /tokenizer_info (what remote-tokenizer clients, such as
lm-evaluation-harness's, read to tokenize through the server)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response

from pocketllm import AsyncLLM, PocketLLMError
from pocketllm_server.app_state import read_model_request, state_of
from pocketllm_server.chat_turn import conversation
from pocketllm_server.errors import from_engine_error, invalid_request
from pocketllm_server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
    json_response,
)


async def tokenize(request: Request) -> Response:
    _, req, llm = await read_model_request(request, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise invalid_request("give exactly one of prompt and messages", "prompt")
    try:  # off the event loop: tokenizing grows with the text
        ids = await asyncio.to_thread(_tokenize, req, llm)
    except PocketLLMError as e:
        raise from_engine_error(e) from None
    return json_response(TokenizeResponse(count=len(ids), max_model_len=llm.max_model_len, tokens=ids))


def _tokenize(req: TokenizeRequest, llm: AsyncLLM) -> list[int]:
    if req.prompt is not None:
        llm.check_text_length(req.prompt)
        return llm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    assert req.messages is not None
    text, ids = llm.render_chat(conversation(req.messages),
                                add_generation_prompt=req.add_generation_prompt, tools=req.tools,
                                chat_template_kwargs=req.chat_template_kwargs)
    # On top of what the template already wrote, as vLLM does.
    return llm.tokenizer.encode(text, add_special_tokens=True) if req.add_special_tokens else ids


async def detokenize(request: Request) -> Response:
    _, req, llm = await read_model_request(request, DetokenizeRequest)
    # Off the event loop: checking and decoding grow with the list (a 4 MiB body holds two million ids).
    return json_response(DetokenizeResponse(prompt=await asyncio.to_thread(_detokenize, req.tokens, llm)))


def _detokenize(tokens: list[int], llm: AsyncLLM) -> str:
    vocab_size = llm.tokenizer.vocab_size
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise invalid_request(f"token id {bad} is not in [0, {vocab_size})", "tokens")
    # Special tokens are kept so that tokenize -> detokenize gives back the text that was tokenized.
    return llm.tokenizer.decode(tokens, skip_special_tokens=False)


async def tokenizer_info(request: Request) -> Response:
    llm = state_of(request).require_llm()
    tokenizer = llm.tokenizer
    return json_response(TokenizerInfo(eos_token=tokenizer.eos_token, bos_token=tokenizer.bos_token,
                                       chat_template=tokenizer.chat_template, model_max_length=llm.max_model_len,
                                       vocab_size=tokenizer.vocab_size))
