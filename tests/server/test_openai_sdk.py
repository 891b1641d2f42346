"""The official openai SDK against a real hypercorn server: echo backend for protocol shape, torch for sampling, the
default model with default flags for tools."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from collections.abc import Iterator

import httpx
import openai
import pytest

from pocketllm import AsyncLLM, EngineArgs, SamplingParams
from pocketllm_server import create_app
from tests.server.conftest import running

MODEL = "tiny"
GREEDY = {"temperature": 0.0}


def echo_ids(prompt_ids: list[int], count: int) -> list[int]:
    """What the echo backend generates: the prompt again, cyclically."""
    return [prompt_ids[i % len(prompt_ids)] for i in range(count)]


def echo_text(llm: AsyncLLM, prompt_ids: list[int], count: int) -> str:
    return llm.tokenizer.decode(echo_ids(prompt_ids, count))


@pytest.fixture(scope="module")
def sdk(echo_server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{echo_server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def torch_sdk(torch_server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{torch_server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]


def test_models(sdk: openai.OpenAI) -> None:
    [card] = sdk.models.list().data
    assert card.id == MODEL and card.object == "model"
    assert sdk.models.retrieve(MODEL) == card
    with pytest.raises(openai.NotFoundError) as error:
        sdk.models.retrieve("gpt-4o")
    assert error.value.body == {"message": "The model `gpt-4o` does not exist; this server serves `tiny`.",
                                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


def test_a_model_named_with_slashes_is_retrieved_by_its_name(tiny_args: EngineArgs, echo_llm: AsyncLLM) -> None:
    """vLLM serves a Hugging Face id ("org/model") by default: the SDK's retrieve puts it in the path as it is."""
    with running(create_app(tiny_args, served_model_name="org/tiny-v1", llm=echo_llm)) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        assert client.models.retrieve("org/tiny-v1").id == "org/tiny-v1"
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("org/other")


def test_chat_completion(sdk: openai.OpenAI, echo_llm: AsyncLLM) -> None:
    _, prompt_ids = echo_llm.render_chat(MESSAGES)
    response = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=7, user="someone", **GREEDY)
    assert response.object == "chat.completion" and response.model == MODEL
    assert response.id.startswith("chatcmpl-")
    [choice] = response.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content == echo_text(echo_llm, prompt_ids, 7)
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids), 7)
    assert response.usage.total_tokens == len(prompt_ids) + 7


def test_chat_max_completion_tokens_and_n(sdk: openai.OpenAI, echo_llm: AsyncLLM) -> None:
    _, prompt_ids = echo_llm.render_chat(MESSAGES)
    response = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=5, n=2, **GREEDY)
    assert [c.index for c in response.choices] == [0, 1]
    assert {c.message.content for c in response.choices} == {echo_text(echo_llm, prompt_ids, 5)}
    assert response.usage is not None and response.usage.completion_tokens == 10


def test_chat_default_max_tokens_fills_the_context(sdk: openai.OpenAI, echo_llm: AsyncLLM) -> None:
    response = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    assert response.choices[0].finish_reason == "length"
    assert response.usage is not None
    assert response.usage.prompt_tokens + response.usage.completion_tokens == echo_llm.args.max_model_len


def test_chat_stream_with_usage_and_n(sdk: openai.OpenAI, echo_llm: AsyncLLM) -> None:
    _, prompt_ids = echo_llm.render_chat(MESSAGES)
    stream = sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=9, n=2, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    assert {c.object for c in chunks} == {"chat.completion.chunk"} and len({c.id for c in chunks}) == 1
    roles = {c.choices[0].index: c.choices[0].delta.role for c in chunks[:2]}
    assert roles == {0: "assistant", 1: "assistant"}
    text: dict[int, str] = defaultdict(str)
    finish: dict[int, str | None] = {}
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        text[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finish[choice.index] = choice.finish_reason
        assert chunk.usage is None
    assert dict(text) == {0: echo_text(echo_llm, prompt_ids, 9), 1: echo_text(echo_llm, prompt_ids, 9)}
    assert finish == {0: "length", 1: "length"}
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt_ids), 18)


def test_chat_stream_without_usage(sdk: openai.OpenAI) -> None:
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True, **GREEDY))
    assert all(c.usage is None and c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_stop_string(sdk: openai.OpenAI, echo_llm: AsyncLLM, stream: bool) -> None:
    _, prompt_ids = echo_llm.render_chat(MESSAGES)
    full = echo_text(echo_llm, prompt_ids, 20)
    stop = full[6:8]
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20, "stop": [stop, "never-seen"], **GREEDY}
    if stream:
        chunks = list(sdk.chat.completions.create(stream=True, **kwargs))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish_reason = chunks[-1].choices[0].finish_reason
    else:
        choice = sdk.chat.completions.create(**kwargs).choices[0]
        content, finish_reason = choice.message.content, choice.finish_reason
    assert content == full[:full.index(stop)]
    assert finish_reason == "stop"


def test_completion(sdk: openai.OpenAI, echo_llm: AsyncLLM) -> None:
    prompt_ids = echo_llm.tokenizer.encode("the cat sat on")
    response = sdk.completions.create(model=MODEL, prompt="the cat sat on", max_tokens=6, **GREEDY)
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    [choice] = response.choices
    assert choice.text == echo_text(echo_llm, prompt_ids, 6) and choice.finish_reason == "length"
    assert response.usage is not None
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(prompt_ids), 6)


def test_completion_default_max_tokens_is_16(sdk: openai.OpenAI) -> None:
    response = sdk.completions.create(model=MODEL, prompt="one two three", **GREEDY)
    assert response.usage is not None and response.usage.completion_tokens == 16


def test_completion_stream_with_usage(sdk: openai.OpenAI, echo_llm: AsyncLLM) -> None:
    prompt_ids = echo_llm.tokenizer.encode("the cat sat on")
    chunks = list(sdk.completions.create(model=MODEL, prompt="the cat sat on", max_tokens=6, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    assert {c.object for c in chunks} == {"text_completion"}
    assert "".join(c.choices[0].text for c in chunks[:-1]) == echo_text(echo_llm, prompt_ids, 6)
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("stream", [False, True])
def test_completion_batch_of_prompts_with_n(sdk: openai.OpenAI, echo_llm: AsyncLLM, stream: bool) -> None:
    prompts = ["a b", "the sea and the ships", "x"]
    kwargs = {"model": MODEL, "prompt": prompts, "max_tokens": 4, "n": 2, **GREEDY}
    if stream:
        text: dict[int, str] = defaultdict(str)
        chunks = list(sdk.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
        for chunk in chunks[:-1]:
            [choice] = chunk.choices
            text[choice.index] += choice.text
        usage = chunks[-1].usage
    else:
        response = sdk.completions.create(**kwargs)
        text = {c.index: c.text for c in response.choices}
        assert [c.index for c in response.choices] == list(range(6))
        usage = response.usage
    expected = {i * 2 + j: echo_text(echo_llm, echo_llm.tokenizer.encode(p), 4)
                for i, p in enumerate(prompts) for j in range(2)}
    assert dict(text) == expected
    assert usage is not None
    assert usage.prompt_tokens == sum(len(echo_llm.tokenizer.encode(p)) for p in prompts)
    assert usage.completion_tokens == 3 * 2 * 4


def test_completion_token_id_prompts(sdk: openai.OpenAI, echo_llm: AsyncLLM) -> None:
    a, b = echo_llm.tokenizer.encode("one two"), echo_llm.tokenizer.encode("three")
    single = sdk.completions.create(model=MODEL, prompt=a, max_tokens=3, **GREEDY)
    assert single.choices[0].text == echo_text(echo_llm, a, 3)
    batch = sdk.completions.create(model=MODEL, prompt=[a, b], max_tokens=3, **GREEDY)
    assert [c.text for c in batch.choices] == [echo_text(echo_llm, a, 3), echo_text(echo_llm, b, 3)]


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo(sdk: openai.OpenAI, echo_llm: AsyncLLM, stream: bool) -> None:
    prompt_ids = echo_llm.tokenizer.encode("ships")
    kwargs = {"model": MODEL, "prompt": "ships", "max_tokens": 5, "echo": True, **GREEDY}
    if stream:
        text = "".join(c.choices[0].text for c in sdk.completions.create(stream=True, **kwargs))
    else:
        text = sdk.completions.create(**kwargs).choices[0].text
    assert text == "ships" + echo_text(echo_llm, prompt_ids, 5)


# -- sampling, logprobs and seeds need a real model: the torch backend ---------------------------------------------

def test_chat_logprobs(torch_sdk: openai.OpenAI) -> None:
    response = torch_sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True,
                                                 top_logprobs=3, extra_body={"ignore_eos": True}, **GREEDY)
    [choice] = response.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == 4
    # A character may span tokens: the tokens' bytes, joined, are the reply.
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8", errors="replace") == choice.message.content
    for entry in entries:
        assert entry.logprob <= 0.0
        if "\ufffd" not in entry.token:  # a token that is whole characters is its own bytes
            assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the most likely one
    streamed = torch_sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, logprobs=True,
                                                 top_logprobs=3, stream=True, extra_body={"ignore_eos": True},
                                                 **GREEDY)
    streamed_entries = [e for c in streamed if c.choices and c.choices[0].logprobs
                        for e in c.choices[0].logprobs.content or []]
    assert [(e.token, round(e.logprob, 4)) for e in streamed_entries] == [
        (e.token, round(e.logprob, 4)) for e in entries]


def test_completion_logprobs(torch_sdk: openai.OpenAI) -> None:
    response = torch_sdk.completions.create(model=MODEL, prompt="the cat", max_tokens=5, logprobs=2,
                                            extra_body={"ignore_eos": True}, **GREEDY)
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs or []) == len(logprobs.top_logprobs or []) == 5
    assert "".join(logprobs.tokens) == response.choices[0].text
    offsets = logprobs.text_offset or []
    assert offsets[0] == 0 and offsets == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]
    for token, top in zip(logprobs.tokens, logprobs.top_logprobs or [], strict=True):
        assert token in top and 2 <= len(top) <= 3


def test_seed_makes_sampling_reproducible(torch_sdk: openai.OpenAI, torch_llm: AsyncLLM) -> None:
    # The tiny random model is all but deterministic; lifting its 20 likeliest first tokens to the same logit
    # with logit_bias makes each sample a 1-in-20 draw, so seeds matter.
    greedy = asyncio.run(torch_llm.complete("the sea", SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)))
    top = (greedy.outputs[0].logprobs or [])[0].top
    bias = {str(t.token_id): min(100.0, top[0].logprob - t.logprob) for t in top}

    def sample(seed: int, n: int = 1) -> list[str]:
        response = torch_sdk.completions.create(model=MODEL, prompt="the sea", max_tokens=1, temperature=1.0,
                                                seed=seed, n=n, logit_bias=bias)
        return [c.text for c in response.choices]

    first = sample(1234, n=4)
    assert sample(1234, n=4) == first
    assert len(set(first)) > 1  # each choice samples with its own seed
    assert len({text for seed in range(6) for text in sample(seed)}) > 1


def test_sampling_fields_reach_the_engine(torch_sdk: openai.OpenAI, torch_llm: AsyncLLM) -> None:
    # A +100 bias makes one token win every step, whatever the model says.
    token_id = torch_llm.tokenizer.encode("sh")[0]
    response = torch_sdk.completions.create(
        model=MODEL, prompt="the sea", max_tokens=4, logit_bias={str(token_id): 100}, temperature=0.8, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, seed=7,
        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 2})
    assert response.choices[0].text == "sh" * 4


# -- tools, as a client sends them without knowing the server's flags: the default model, default flags ------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def smol_sdk() -> Iterator[openai.OpenAI]:
    """A server started with default flags on the default model (cpp, what ``auto`` picks on x86 CPUs)."""
    pytest.importorskip("pocketllm_cpp")
    args = EngineArgs(model="smollm2-135m-instruct", backend="cpp")
    llm = AsyncLLM(engine_args=args)
    with running(create_app(args, served_model_name="smol", llm=llm)) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client
    llm.shutdown()


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_tool_calls_need_no_server_flag(smol_sdk: openai.OpenAI, choice: str | dict) -> None:
    """tool_choice required or a named function, on a server started without --tool-call-parser (vLLM serves
    both so): one call, valid under its schema, streamed or not."""
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    fields = {"model": "smol", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
              "tools": [WEATHER, TIME], "tool_choice": choice, "temperature": 0.8, "seed": 1, "max_tokens": 120}
    reply = smol_sdk.chat.completions.create(**fields)
    [call] = reply.choices[0].message.tool_calls or []
    assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None, reply
    assert call.function.name == "get_time" if isinstance(choice, dict) else call.function.name in schemas
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    chunks = list(smol_sdk.chat.completions.create(**fields, stream=True))
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert (deltas[0].function.name, "".join(d.function.arguments or "" for d in deltas)) == (
        call.function.name, call.function.arguments)


def test_legacy_functions_are_answered_in_the_legacy_shape(smol_sdk: openai.OpenAI) -> None:
    """A request with functions (not tools) gets OpenAI's legacy reply: message.function_call and finish_reason
    "function_call", delta.function_call when streamed; one call, as that API has no parallel calls."""
    jsonschema = pytest.importorskip("jsonschema")
    function = WEATHER["function"]
    fields = {"model": "smol", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
              "functions": [function, TIME["function"]], "function_call": {"name": "get_weather"},
              "temperature": 0.8, "seed": 1, "max_tokens": 120}
    [choice] = smol_sdk.chat.completions.create(**fields).choices
    call = choice.message.function_call
    assert choice.finish_reason == "function_call" and not choice.message.tool_calls, choice
    assert call is not None and call.name == "get_weather" and choice.message.content is None
    jsonschema.validate(json.loads(call.arguments), function["parameters"])
    chunks = list(smol_sdk.chat.completions.create(**fields, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not any(d.tool_calls for d in deltas) and chunks[-1].choices[0].finish_reason == "function_call"
    calls = [d.function_call for d in deltas if d.function_call]
    assert (calls[0].name, "".join(c.arguments or "" for c in calls)) == (call.name, call.arguments)
    # The conversation goes on as legacy clients send it: the call in the assistant message, its result in a
    # "function" message; the template sees them as a tool call and the tool message that answers it.
    history = [*fields["messages"], {"role": "assistant", "content": None,
                                     "function_call": {"name": call.name, "arguments": call.arguments}},
               {"role": "function", "name": call.name, "content": '{"temperature": "21 C, sunny"}'}]
    follow_up = smol_sdk.chat.completions.create(**(fields | {"messages": history, "function_call": "none"}))
    assert follow_up.choices[0].finish_reason in ("stop", "length") and follow_up.choices[0].message.content
    root = str(smol_sdk.base_url).removesuffix("/").removesuffix("/v1")
    rendered = httpx.post(f"{root}/tokenize", timeout=30, json={"model": "smol", "messages": history,
                                                                "tools": [WEATHER, TIME]}).json()
    text = httpx.post(f"{root}/detokenize", json={"model": "smol", "tokens": rendered["tokens"]}, timeout=30).json()
    assert "21 C, sunny" in text["prompt"] and call.name in text["prompt"]
    both = [*fields["messages"], {**history[1], "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": call.name, "arguments": call.arguments}}]}]
    with pytest.raises(openai.BadRequestError, match="both tool_calls and the legacy function_call"):
        smol_sdk.chat.completions.create(**(fields | {"messages": both}))
