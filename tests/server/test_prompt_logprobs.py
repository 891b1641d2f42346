"""Prompt logprobs over HTTP: /v1/completions with echo and logprobs (OpenAI's legacy API, as evaluation harnesses
use it), vLLM's prompt_logprobs, and scoring requests (max_tokens 0), on the tiny model on each backend; they equal
the library's SamplingParams.prompt_logprobs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from pocketllm import AsyncLLM, ConfigError, EngineArgs, SamplingParams
from pocketllm.limits import MAX_PROMPT_LOGPROB_ENTRIES, MAX_REQUEST_PROMPT_LOGPROB_ENTRIES
from pocketllm_server import create_app
from tests.server.conftest import LiveServer

MODEL = "tiny"


@pytest.fixture(scope="module", params=["torch", "cpp"])
def scorer(request: pytest.FixtureRequest, live_server, pocketllm_tiny_llama: Path) -> Iterator[
        tuple[LiveServer, AsyncLLM]]:
    """A server on the tiny model on each backend, and its engine."""
    pytest.importorskip(f"pocketllm_{request.param}")
    llm = AsyncLLM(engine_args=EngineArgs(model=str(pocketllm_tiny_llama), backend=request.param))
    yield live_server(create_app(llm.args, served_model_name=MODEL, llm=llm)), llm
    llm.shutdown()


@pytest.fixture(scope="module")
def sdk(scorer: tuple[LiveServer, AsyncLLM]) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{scorer[0].url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def library_scores(llm: AsyncLLM, ids: list[int], k: int) -> list:
    """What the library's SamplingParams.prompt_logprobs say of ``ids``, on the server's own engine."""
    return asyncio.run(llm.complete(ids, SamplingParams(max_tokens=0, prompt_logprobs=k))).prompt_logprobs


def test_echo_with_logprobs_scores_the_prompt(sdk: openai.OpenAI, scorer: tuple[LiveServer, AsyncLLM]) -> None:
    llm = scorer[1]
    ids = llm.tokenizer.encode("the cat sat on the mat", add_special_tokens=False)
    scored = library_scores(llm, ids, 2)
    whole = sdk.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=0, temperature=0)
    [choice] = whole.choices
    assert choice.text == llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert choice.finish_reason == "length" and whole.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in scored[1:]], abs=1e-5)
    assert all(len(top) in (2, 3) and lp.token_logprobs[i + 1] in top.values()
               for i, top in enumerate(lp.top_logprobs[1:]))
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    # One token more: the prompt's logprobs, then the completion's, offsets running on after the echo.
    more = sdk.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=1, temperature=0)
    lp1 = more.choices[0].logprobs
    assert lp1.token_logprobs[:len(ids)] == lp.token_logprobs and len(lp1.tokens) == len(ids) + 1
    assert lp1.text_offset[-1] == len(choice.text) and more.choices[0].text.startswith(choice.text)
    streamed = list(sdk.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=1,
                                           temperature=0, stream=True))
    tokens = [t for chunk in streamed for c in chunk.choices if c.logprobs for t in c.logprobs.tokens]
    values = [v for chunk in streamed for c in chunk.choices if c.logprobs for v in c.logprobs.token_logprobs]
    assert tokens == lp1.tokens and values == pytest.approx(lp1.token_logprobs, abs=1e-5)
    assert "".join(c.text for chunk in streamed for c in chunk.choices) == more.choices[0].text


def test_vllm_prompt_logprobs(scorer: tuple[LiveServer, AsyncLLM]) -> None:
    server, llm = scorer
    ids = llm.tokenizer.encode("1 2 3 4", add_special_tokens=False)
    scored = library_scores(llm, ids, 3)
    for stream in (False, True):
        body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 3,
                "stream": stream}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        if stream:
            chunks = [httpx.Response(200, content=line[6:]).json() for line in response.text.splitlines()
                      if line.startswith("data: {")]
            [positions] = [c["choices"][0]["prompt_logprobs"] for c in chunks if c["choices"]
                           and c["choices"][0].get("prompt_logprobs")]
        else:
            positions = response.json()["choices"][0]["prompt_logprobs"]
        assert positions[0] is None and len(positions) == len(ids)
        for token, position, entry in zip(ids[1:], positions[1:], scored[1:], strict=True):
            assert position[str(token)]["logprob"] == pytest.approx(entry.logprob, abs=1e-5)
            assert position[str(token)]["rank"] == entry.rank and 3 <= len(position) <= 4


def test_scoring_needs_echo_or_prompt_logprobs(scorer: tuple[LiveServer, AsyncLLM]) -> None:
    server = scorer[0]
    response = httpx.post(f"{server.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": "hi", "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    echo_only = httpx.post(f"{server.url}/v1/completions", timeout=30,
                           json={"model": MODEL, "prompt": "hi", "max_tokens": 0, "echo": True}).json()
    assert echo_only["choices"][0]["text"] == "hi" and echo_only["usage"]["completion_tokens"] == 0


def test_prompt_logprobs_are_bounded_by_what_they_cost(scorer: tuple[LiveServer, AsyncLLM]) -> None:
    """Prompt tokens x (alternatives + 1) x choices: at most MAX_PROMPT_LOGPROB_ENTRIES a prompt, and
    MAX_REQUEST_PROMPT_LOGPROB_ENTRIES summed over a request's prompts. 80 prompts of 40 tokens with 20 alternatives
    and 16 choices ask for 1,075,200 (each prompt for 13,440); the 400 names prompt_logprobs, as echo's scoring is."""
    server, llm = scorer
    ids = [llm.tokenizer.encode("the cat sat on the mat", add_special_tokens=False)[i % 3] for i in range(40)]
    assert 80 * 40 * 21 * 16 > MAX_REQUEST_PROMPT_LOGPROB_ENTRIES >= 40 * 40 * 21 * 16
    body = {"model": MODEL, "prompt": [ids] * 80, "n": 16, "max_tokens": 1, "temperature": 0}
    for extra in ({"echo": True, "logprobs": 20}, {"prompt_logprobs": 20}):
        response = httpx.post(f"{server.url}/v1/completions", timeout=30, json=body | extra)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "prompt_logprobs" and "1,075,200 prompt logprobs" in error["message"], error
    assert 400 * 21 * 16 > MAX_PROMPT_LOGPROB_ENTRIES >= 40 * 21 * 16
    alone = httpx.post(f"{server.url}/v1/completions", timeout=60, json=body | {"prompt": ids, "prompt_logprobs": 20})
    assert alone.status_code == 200 and len(alone.json()["choices"]) == 16
    with pytest.raises(ConfigError, match="prompt_logprobs"):  # the library's own bound, for one prompt
        asyncio.run(llm.complete(ids * 10, SamplingParams(max_tokens=1, n=16, prompt_logprobs=20)))
