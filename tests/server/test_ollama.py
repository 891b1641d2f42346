"""Ollama's API (/api/*) through Ollama's own Python client: chat and generate (streamed as NDJSON and not) give
what the library gives, options map onto the engine's parameters or are refused by name, tool calls come back with
object arguments, embeddings are unit vectors, the model is described, a client that leaves frees its request,
and --api-key guards /api."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import pytest

from pocketllm import AsyncLLM, EngineArgs, RequestOutput, SamplingParams
from pocketllm.testing import StepGate
from pocketllm_server import create_app
from tests.conftest import requires_default_model
from tests.server.conftest import MODEL_NAME, LiveServer

GREEDY = {"temperature": 0}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


def text_of(output: RequestOutput) -> str:
    return output.outputs[0].text


@pytest.fixture(scope="module")
def client(echo_server: LiveServer) -> Iterator[ollama.Client]:
    """Ollama's client on the echo backend, which replays the rendered prompt (greedy only)."""
    with ollama.Client(host=echo_server.url) as client:
        yield client


@pytest.fixture(scope="module")
def replay(tiny_with_template, live_server) -> Iterator[tuple[AsyncLLM, ollama.Client]]:
    """A template that shows only the last message: the echo backend's reply is the user's text, exactly, for as
    many tokens as the text has (then it starts over)."""
    llm = AsyncLLM(engine_args=EngineArgs(model=str(tiny_with_template("{{ messages[-1].content }}")),
                                          backend="echo"))
    server = live_server(create_app(llm.args, served_model_name=MODEL_NAME, llm=llm))
    with ollama.Client(host=server.url) as client:
        yield llm, client
    llm.shutdown()


def replayed(llm: AsyncLLM, text: str) -> dict[str, Any]:
    """Options under which the replaying server answers ``text`` once."""
    return {**GREEDY, "num_predict": len(llm.render_chat([{"role": "user", "content": text}])[1])}


@pytest.fixture(scope="module")
def smol(live_server) -> Iterator[tuple[AsyncLLM, ollama.Client]]:
    """The default model on the cpp backend, which samples, has grammars and pools embeddings."""
    pytest.importorskip("pocketllm_cpp")
    llm = AsyncLLM(engine_args=EngineArgs(model="smollm2-135m-instruct", backend="cpp"))
    server = live_server(create_app(llm.args, served_model_name="smol", llm=llm))
    with ollama.Client(host=server.url) as client:
        yield llm, client
    llm.shutdown()


def refusal(call: Any) -> str:
    """The message of the 400 that ``call()`` gets."""
    with pytest.raises(ollama.ResponseError) as info:
        call()
    assert info.value.status_code == 400, info.value
    return info.value.error


# -- chat and generate ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_chat_replies_as_the_library_does(client: ollama.Client, echo_llm: AsyncLLM, stream: bool) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    expected = asyncio.run(echo_llm.chat(messages, SamplingParams(temperature=0, max_tokens=20)))
    options = {**GREEDY, "num_predict": 20}
    if stream:
        parts = list(client.chat(model=MODEL_NAME, messages=messages, options=options, stream=True))
        *chunks, last = parts
        assert all(not c.done and c.message.role == "assistant" for c in chunks) and last.done
        assert "".join(c.message.content for c in chunks) == text_of(expected) and last.message.content == ""
    else:
        last = client.chat(model=MODEL_NAME, messages=messages, options=options)
        assert last.message.content == text_of(expected) and last.message.tool_calls is None
    assert (last.model, last.done_reason, last.eval_count) == (MODEL_NAME, "length", 20)
    assert last.prompt_eval_count == len(expected.prompt_token_ids) and last.load_duration == 0
    assert last.total_duration >= last.eval_duration > 0 and last.prompt_eval_duration > 0
    assert last.created_at.endswith("Z")


def test_a_stream_is_ndjson(echo_server: LiveServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "the sea", "raw": True, "options": {**GREEDY, "num_predict": 3}}
    with httpx.stream("POST", f"{echo_server.url}/api/generate", json=body) as response:
        assert response.headers["content-type"] == "application/x-ndjson"
        lines = list(response.iter_lines())
    assert [json.loads(line)["done"] for line in lines] == [False] * (len(lines) - 1) + [True]


@pytest.mark.parametrize("stream", [False, True])
def test_generate_raw_and_templated(client: ollama.Client, echo_llm: AsyncLLM, stream: bool) -> None:
    def generate(**fields: Any) -> tuple[str, ollama.GenerateResponse]:
        if not stream:
            reply = client.generate(model=MODEL_NAME, options={**GREEDY, "num_predict": 12}, **fields)
            return reply.response, reply
        *chunks, last = client.generate(model=MODEL_NAME, options={**GREEDY, "num_predict": 12}, stream=True,
                                        **fields)
        return "".join(c.response for c in chunks), last

    params = SamplingParams(temperature=0, max_tokens=12)
    raw, last = generate(prompt="the sea is", raw=True)
    expected = asyncio.run(echo_llm.complete("the sea is", params))
    assert raw == text_of(expected) and last.prompt_eval_count == len(expected.prompt_token_ids)
    templated, last = generate(prompt="the sea is", system="Be brief.")
    expected = asyncio.run(echo_llm.chat([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "the sea is"}], params))
    assert templated == text_of(expected) and (last.done, last.done_reason, last.eval_count) == (True, "length", 12)


def test_an_empty_prompt_only_loads(client: ollama.Client) -> None:
    loaded = client.generate(model=MODEL_NAME, prompt="", keep_alive="5m")
    assert (loaded.response, loaded.done, loaded.done_reason) == ("", True, "load")
    loaded = client.chat(model=MODEL_NAME, messages=[])
    assert (loaded.message.content, loaded.done_reason) == ("", "load")


@pytest.mark.parametrize("stream", [False, True])
def test_think_switches_the_template_and_reasoning_comes_apart(tiny_with_template, serve_app, stream: bool) -> None:
    """A template with Qwen3's switch, on a server that splits reasoning: ``think`` sets the switch (false writes
    "NO " before the replayed text), and the reasoning comes in ``thinking``."""
    template = "{% if enable_thinking is defined and not enable_thinking %}NO {% endif %}{{ messages[-1].content }}"
    llm = AsyncLLM(engine_args=EngineArgs(model=str(tiny_with_template(template)), backend="echo"))
    text = "<think>I ponder.</think>The answer."
    try:
        with serve_app(create_app(llm.args, served_model_name=MODEL_NAME, llm=llm, reasoning_parser="qwen3")) \
                as server, ollama.Client(host=server.url) as client:
            def ask(think: bool) -> tuple[str, str]:
                messages = [{"role": "user", "content": text}]
                length = len(llm.render_chat(messages, chat_template_kwargs={"enable_thinking": think})[1])
                fields = {"model": MODEL_NAME, "messages": messages, "think": think,
                          "options": {**GREEDY, "num_predict": length}}
                if not stream:
                    message = client.chat(**fields).message
                    return message.thinking or "", message.content
                parts = list(client.chat(**fields, stream=True))
                return "".join(p.message.thinking or "" for p in parts), "".join(p.message.content for p in parts)

            assert ask(True) == ("I ponder.", "The answer.")
            assert ask(False)[1].startswith("NO ")
            assert "thinking" in client.show(MODEL_NAME).capabilities
    finally:
        llm.shutdown()


# -- options -------------------------------------------------------------------------------------------------------

def test_num_predict_and_num_ctx_bound_the_reply(client: ollama.Client, echo_llm: AsyncLLM) -> None:
    messages = [{"role": "user", "content": "hi"}]
    prompt_len = len(echo_llm.render_chat(messages)[1])
    room = echo_llm.max_model_len - prompt_len

    def eval_count(**options: Any) -> tuple[int, str]:
        reply = client.chat(model=MODEL_NAME, messages=messages, options={**GREEDY, **options})
        return reply.eval_count, reply.done_reason

    assert eval_count(num_predict=5) == (5, "length")
    assert eval_count(num_predict=-1) == eval_count(num_predict=-2) == (room, "length")
    assert eval_count(num_predict=10 * room) == (room, "length")  # where Ollama would shift the context
    assert eval_count(num_ctx=prompt_len + 3) == (3, "length")
    assert eval_count(num_ctx=10 * echo_llm.max_model_len, num_predict=4) == (4, "length")  # capped to max_model_len
    assert "no room" in refusal(lambda: eval_count(num_ctx=prompt_len))
    assert "num_predict" in refusal(lambda: eval_count(num_predict=0))


def test_stop_ends_the_reply(replay: tuple[AsyncLLM, ollama.Client]) -> None:
    _, client = replay
    reply = client.chat(model=MODEL_NAME, messages=[{"role": "user", "content": "one two STOP three"}],
                        options={**GREEDY, "num_predict": 30, "stop": ["STOP"]})
    assert (reply.message.content, reply.done_reason) == ("one two ", "stop")
    raw = client.generate(model=MODEL_NAME, prompt="a b c", raw=True, options={**GREEDY, "stop": ["b"]})
    assert raw.response.strip() == "a" and raw.done_reason == "stop"


@pytest.mark.parametrize(("options", "named"), [
    ({"nucleus": 0.5}, "nucleus"),  # unknown
    ({"typical_p": 0.7}, "typical_p"), ({"mirostat": 1}, "mirostat"), ({"tfs_z": 0.5}, "tfs_z"),
    ({"repeat_penalty": 1.1, "repeat_last_n": 33}, "repeat_last_n"), ({"penalize_newline": False}, "penalize_newline"),
    ({"repeat_penalty": 9.0}, "repeat_penalty"),
])
def test_options_the_engine_cannot_honour_are_refused_by_name(client: ollama.Client, options: dict,
                                                              named: str) -> None:
    assert named in refusal(lambda: client.chat(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                options={**GREEDY, **options}))


@pytest.mark.parametrize("keep_alive", [-1, 0, 300, 2.5, "5m", "1h30m", "-1s", ".5s", "0", "300ms", "2562047h"])
def test_keep_alive_takes_what_ollama_reads(client: ollama.Client, keep_alive: float | str) -> None:
    """Seconds (negative: forever) or a Go duration; the model stays loaded either way."""
    assert client.generate(model=MODEL_NAME, prompt="", keep_alive=keep_alive).done_reason == "load"


@pytest.mark.parametrize("keep_alive", ["forever", "5", "1h 30m", "5M", "1d", "", "2562048h"])
def test_keep_alive_ollama_cannot_read_is_refused(client: ollama.Client, keep_alive: str) -> None:
    """As Ollama answers it: "time: invalid duration", on every route that takes keep_alive."""
    calls = [lambda: client.generate(model=MODEL_NAME, prompt="", keep_alive=keep_alive),
             lambda: client.chat(model=MODEL_NAME, messages=[], keep_alive=keep_alive),
             lambda: client.embed(model=MODEL_NAME, input=[], keep_alive=keep_alive),
             lambda: client.embeddings(model=MODEL_NAME, prompt="", keep_alive=keep_alive)]
    for call in calls:
        assert "keep_alive: time: invalid duration" in refusal(call)


def test_neutral_and_load_time_options_are_accepted(client: ollama.Client) -> None:
    options = {**GREEDY, "num_predict": 2, "typical_p": 1.0, "mirostat": 0, "mirostat_tau": 5.0, "tfs_z": 1,
               "repeat_last_n": 64, "penalize_newline": True, "num_thread": 8, "num_gpu": 1, "main_gpu": 0,
               "num_batch": 512, "use_mmap": True, "use_mlock": False, "numa": False, "low_vram": False,
               "num_keep": 4, "vocab_only": False, "f16_kv": True, "logits_all": False, "seed": -1}
    assert client.generate(model=MODEL_NAME, prompt="hi", options=options, keep_alive=-1).eval_count == 2


def test_refusals_are_in_ollama_s_shape(echo_server: LiveServer, client: ollama.Client) -> None:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}
    response = httpx.post(f"{echo_server.url}/api/chat", json=body)
    assert response.status_code == 400 and list(response.json()) == ["error"]
    assert "messages.0.images" in response.json()["error"]
    # The template has no thinking switch, and the server splits no reasoning: the model does not think.
    assert "think" in refusal(lambda: client.chat(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                  think=True))
    assert "think" in refusal(lambda: client.generate(model=MODEL_NAME, prompt="hi", think="high"))
    assert "logprobs" in refusal(lambda: client.chat(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                                     logprobs=True))
    for fields in ({"suffix": "end"}, {"template": "{{ .Prompt }}"}, {"context": [1, 2]}, {"images": ["aGk="]},
                   {"system": "x", "raw": True}):
        assert next(iter(fields)) in refusal(lambda f=fields: client.generate(model=MODEL_NAME, prompt="hi", **f))
    response = httpx.post(f"{echo_server.url}/api/generate", json={"model": MODEL_NAME, "prompt": "hi",
                                                                   "format": "yaml"})
    assert response.status_code == 400 and "format" in response.json()["error"]
    for body in ({"options": {"num_predict": 2**63}}, {"tools": [{"type": "function"}]}):  # past int64; no function
        response = httpx.post(f"{echo_server.url}/api/chat", json={"model": MODEL_NAME, "stream": False,
                                                                   "messages": [{"role": "user", "content": "hi"}],
                                                                   **body})
        assert response.status_code == 400 and list(response.json()) == ["error"], response.text
    assert "pool" in refusal(lambda: client.embed(model=MODEL_NAME, input="hi"))  # the echo backend has no pooling
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="llama3.2", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404 and "llama3.2" in info.value.error


# -- tools ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_have_object_arguments(replay: tuple[AsyncLLM, ollama.Client], stream: bool) -> None:
    """The template shows no tools: they go in a system message asking for the generic format, which the
    replayed user text is in."""
    llm, client = replay
    call = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
    fields = {"model": MODEL_NAME, "messages": [{"role": "user", "content": call}], "tools": TOOLS,
              "options": replayed(llm, call)}
    if stream:
        parts = list(client.chat(**fields, stream=True))
        calls = [c for part in parts for c in part.message.tool_calls or []]
        assert parts[-1].done and "".join(part.message.content for part in parts) == ""
    else:
        reply = client.chat(**fields)
        calls = reply.message.tool_calls
        assert reply.message.content == ""
    assert [(c.function.name, dict(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_a_conversation_with_tool_results_renders(replay: tuple[AsyncLLM, ollama.Client]) -> None:
    llm, client = replay
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "11 degrees", "tool_name": "get_weather"}]
    reply = client.chat(model=MODEL_NAME, messages=messages, tools=TOOLS, options=replayed(llm, "11 degrees"))
    assert reply.message.content == "11 degrees"


# -- the default model: sampling, structured outputs, embeddings ---------------------------------------------------

@requires_default_model
def test_seed_reproduces_and_format_holds(smol: tuple[AsyncLLM, ollama.Client]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    _, client = smol
    messages = [{"role": "user", "content": "Describe a cat in JSON."}]
    sampled = [client.chat(model="smol", messages=messages, options={"temperature": 1.0, "seed": 7,
                                                                     "num_predict": 16}).message.content
               for _ in range(2)]
    assert sampled[0] == sampled[1]
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 30}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = client.chat(model="smol", messages=messages, format=schema, options={"temperature": 0.8, "seed": 1})
    jsonschema.validate(json.loads(reply.message.content), schema)
    # JSON mode bounds no object's length, so only its start is checked: what the model would not say unasked.
    generated = client.generate(model="smol", prompt="Say hello.", format="json",
                                options={"temperature": 0.8, "seed": 1, "num_predict": 8})
    assert generated.response.lstrip().startswith("{")


@requires_default_model
def test_embeddings_are_unit_vectors(smol: tuple[AsyncLLM, ollama.Client]) -> None:
    llm, client = smol
    one = client.embed(model="smol", input="the cat sat")
    [vector] = one.embeddings
    assert abs(math.fsum(x * x for x in vector) - 1) < 1e-4
    assert one.prompt_eval_count == len(llm.encode_prompt("the cat sat")[1]) and one.total_duration > 0
    many = client.embed(model="smol", input=["the cat sat", "a dog ran"])
    assert len(many.embeddings) == 2
    assert max(abs(a - b) for a, b in zip(many.embeddings[0], vector, strict=True)) < 1e-4
    long_text = "word " * 40
    cut = client.embed(model="smol", input=long_text, options={"num_ctx": 8})
    assert cut.prompt_eval_count == 8
    assert "context length" in refusal(lambda: client.embed(model="smol", input=long_text, truncate=False,
                                                            options={"num_ctx": 8}))
    assert client.embed(model="smol", input=[]).embeddings == []
    assert len(client.embed(model="smol", input="hi", dimensions=len(vector)).embeddings[0]) == len(vector)
    # Ollama cuts such vectors short; this model is not trained for that (Matryoshka), so it is refused.
    assert "dimensions" in refusal(lambda: client.embed(model="smol", input="hi", dimensions=64))


@requires_default_model
def test_the_older_embeddings_route(smol: tuple[AsyncLLM, ollama.Client]) -> None:
    """/api/embeddings, as Ollama 0.12 still serves it: one prompt, its vector as pooled (/api/embed normalises
    it), a prompt longer than the context refused, an empty one only loading the model."""
    _, client = smol
    vector = client.embeddings(model="smol", prompt="the cat sat").embedding
    norm = math.sqrt(math.fsum(x * x for x in vector))
    assert abs(norm - 1) > 1e-3
    [normalised] = client.embed(model="smol", input="the cat sat").embeddings
    assert max(abs(x / norm - y) for x, y in zip(vector, normalised, strict=True)) < 1e-4
    assert client.embeddings(model="smol", prompt="").embedding == []
    assert "prompt has" in refusal(lambda: client.embeddings(model="smol", prompt="word " * 40,
                                                             options={"num_ctx": 8}))


@requires_default_model
def test_show_describes_a_gguf_model(smol: tuple[AsyncLLM, ollama.Client]) -> None:
    llm, client = smol
    shown = client.show("smol")
    assert (shown.details.format, shown.details.family, shown.details.quantization_level) == ("gguf", "llama", "Q4_1")
    assert shown.details.parameter_size.endswith("M")
    assert {"completion", "tools", "embedding"} <= set(shown.capabilities)
    assert shown.modelinfo["llama.context_length"] == llm.model_config.max_position_embeddings


# -- the model, described ------------------------------------------------------------------------------------------

def test_list_show_and_version(client: ollama.Client, echo_server: LiveServer, echo_llm: AsyncLLM) -> None:
    [listed] = client.list().models
    assert listed.model == MODEL_NAME and listed.size > 0 and listed.modified_at is not None
    assert (listed.details.format, listed.details.family, listed.details.families) == ("safetensors", "llama",
                                                                                       ["llama"])
    shown = client.show(MODEL_NAME)
    assert shown.template == echo_llm.tokenizer.chat_template and shown.details == listed.details
    assert shown.capabilities == ["completion", "tools"]  # echo pools no embeddings; no reasoning is split
    assert shown.modelinfo["general.architecture"] == "llama"
    assert f"num_ctx {echo_llm.max_model_len}" in " ".join(shown.parameters.split())
    assert "FROM " in shown.modelfile
    legacy = httpx.post(f"{echo_server.url}/api/show", json={"model": "", "name": MODEL_NAME})
    assert legacy.status_code == 200 and legacy.json()["details"]["family"] == "llama"
    with pytest.raises(ollama.ResponseError) as info:
        client.show("llama3.2")
    assert info.value.status_code == 404
    assert client.show(f"{MODEL_NAME}:latest").details == listed.details  # an untagged name's tag, to Ollama
    with pytest.raises(ollama.ResponseError):
        client.show(f"{MODEL_NAME}:7b")
    assert httpx.get(f"{echo_server.url}/api/version").json() == {"version": "0.12.0"}


def test_ps_lists_the_loaded_model(client: ollama.Client, echo_llm: AsyncLLM) -> None:
    """The served model, loaded for as long as the server runs: Ollama's expiry for keep_alive -1 (the longest Go
    duration from now, in 2318 or later), and none of it in GPU memory on the CPU."""
    [listed] = client.list().models
    [running] = client.ps().models
    assert (running.name, running.model, running.size, running.details) == (MODEL_NAME, MODEL_NAME, listed.size,
                                                                            listed.details)
    assert running.size_vram == 0 and running.context_length == echo_llm.max_model_len
    assert running.expires_at is not None and running.expires_at.year >= 2318


# -- leaving, and the API key --------------------------------------------------------------------------------------

LONG_REQUESTS = [("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}),
                 ("/api/generate", {"prompt": "the sea", "raw": True})]


@pytest.mark.parametrize(("path", "body"), LONG_REQUESTS)
def test_leaving_mid_stream_aborts_the_request(gated_server: LiveServer, gated_llm: AsyncLLM, gate: StepGate,
                                               wait_for, path: str, body: dict) -> None:
    gate.hold()
    gate.release(8)
    body = {"model": MODEL_NAME, **body, "options": {**GREEDY, "num_predict": 400}}
    with httpx.stream("POST", f"{gated_server.url}{path}", json=body) as response:
        lines = response.iter_lines()
        assert all(not json.loads(next(lines))["done"] for _ in range(3))
        assert gated_llm.stats().num_running == 1
    # The engine is held and runs no further step: only an abort can end the request now.
    assert wait_for(lambda: gated_llm.stats().num_running == gated_llm.stats().num_waiting == 0, timeout=2)


@pytest.mark.parametrize(("path", "body"), LONG_REQUESTS)
def test_a_request_ended_mid_stream_ends_with_an_error_object(gated_server: LiveServer, gated_llm: AsyncLLM,
                                                              gate: StepGate, path: str, body: dict) -> None:
    """Only a shutdown aborts a request whose client is still there; aborting it by its id does the same."""
    gate.hold()
    gate.release(4)
    body = {"model": MODEL_NAME, **body, "options": {**GREEDY, "num_predict": 400}}
    with httpx.stream("POST", f"{gated_server.url}{path}", json=body) as response:
        lines = response.iter_lines()
        assert not json.loads(next(lines))["done"]
        gated_llm.abort(response.headers["x-request-id"])
        *_, last = lines
    assert "shutting down" in json.loads(last)["error"]


def test_the_api_key_guards_api(serve_app, tiny_args: EngineArgs, echo_llm: AsyncLLM) -> None:
    with serve_app(create_app(tiny_args, served_model_name=MODEL_NAME, api_key="sk-1", llm=echo_llm)) as server:
        response = httpx.post(f"{server.url}/api/chat", json={"model": MODEL_NAME, "messages": []})
        assert response.status_code == 401 and list(response.json()) == ["error"]
        with ollama.Client(host=server.url) as anonymous:
            with pytest.raises(ollama.ResponseError) as info:
                anonymous.list()
            assert info.value.status_code == 401
        with ollama.Client(host=server.url, headers={"Authorization": "Bearer sk-1"}) as keyed:
            reply = keyed.chat(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                               options={**GREEDY, "num_predict": 2})
            assert reply.eval_count == 2


def test_openapi_lists_the_routes(echo_server: LiveServer) -> None:
    paths = httpx.get(f"{echo_server.url}/openapi.json").json()["paths"]
    assert {"/api/chat", "/api/generate", "/api/embed", "/api/embeddings", "/api/tags", "/api/show", "/api/ps",
            "/api/version"} <= set(paths)
