"""Structured outputs over HTTP on the default model (torch and cpp backends): JSON schemas sampled at temperature 0.8
parse and validate, regex and choice hold, and every bad spec or backend without grammars is a 400 naming its
field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest

from pocketllm import AsyncLLM, EngineArgs
from pocketllm_server import create_app

jsonschema = pytest.importorskip("jsonschema")
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "weather": {"enum": ["sunny", "rainy", "cloudy"]},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 31}, "maxItems": 4}},
     "required": ["city", "weather", "days"], "additionalProperties": False},
    {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 20},
                                                    "last": {"type": "string", "maxLength": 20}},
                   "required": ["first", "last"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"}},
     "required": ["person", "tags", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"type": "number", "minimum": -100, "maximum": 100}, "minItems": 1, "maxItems": 5},
]


@pytest.fixture(scope="module", params=["torch", "cpp"])
def smol(request: pytest.FixtureRequest, live_server) -> Iterator[tuple[EngineArgs, AsyncLLM]]:
    """The default model on each backend that has grammars (cpp is what ``auto`` picks on x86 CPUs)."""
    pytest.importorskip(f"pocketllm_{request.param}")
    args = EngineArgs(model="smollm2-135m-instruct", backend=request.param)
    llm = AsyncLLM(engine_args=args)
    yield args, llm
    llm.shutdown()


@pytest.fixture(scope="module")
def client(live_server, smol) -> Iterator[httpx.Client]:
    server = live_server(create_app(smol[0], served_model_name="smol", llm=smol[1]))
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def chat(client: httpx.Client, **fields: object) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Answer in JSON."}], "temperature": 0.8, "max_tokens": 200}
    return client.post("/v1/chat/completions", json=body | fields)


def test_json_schemas_sampled_at_temperature_0_8_validate(client: httpx.Client) -> None:
    for i in range(20):
        schema = SCHEMAS[i % len(SCHEMAS)]
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        reply = chat(client, response_format=fmt, seed=i)
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_json_object_and_vllm_s_fields(client: httpx.Client) -> None:
    cat = [{"role": "user", "content": "Describe a cat as a JSON object with a name and a color."}]
    reply = chat(client, response_format={"type": "json_object"}, messages=cat, temperature=0, max_tokens=300)
    assert isinstance(json.loads(reply.json()["choices"][0]["message"]["content"]), dict)
    schema = SCHEMAS[0]
    for fields in ({"guided_json": schema}, {"structured_outputs": {"json": schema}}):
        content = chat(client, **fields).json()["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), schema)


def test_regex_and_choice_hold_streamed_and_not(client: httpx.Client) -> None:
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    for fields in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        assert re.fullmatch(pattern, chat(client, **fields).json()["choices"][0]["message"]["content"])
    choices = ["yes", "no", "maybe later"]
    for seed in range(4):
        assert chat(client, guided_choice=choices, seed=seed).json()["choices"][0]["message"]["content"] in choices
    body = {"prompt": "The answer:", "temperature": 0.8, "max_tokens": 20, "stream": True, "guided_regex": pattern}
    with client.stream("POST", "/v1/completions", json=body) as r:
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                       if line.startswith("data: {"))
    assert re.fullmatch(pattern, text)


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_bad_specs_are_400s_naming_their_field(client: httpx.Client, fields: dict, param: str) -> None:
    reply = chat(client, **fields)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert chat(client, max_tokens=4).status_code == 200  # nothing else is harmed


def test_a_backend_without_grammars_refuses_with_a_400(serve_app, tiny_args, echo_llm) -> None:
    with serve_app(create_app(tiny_args, served_model_name="smol", llm=echo_llm)) as server, \
            httpx.Client(base_url=server.url, timeout=60) as c:
        reply = chat(c, response_format={"type": "json_object"}, temperature=0)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["code"] == "unsupported_option" and error["param"] == "response_format"
    assert "structured_outputs" in error["message"] and "echo" in error["message"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 10}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.mark.parametrize("parser", ["hermes", "qwen3_xml", "llama3_json"])
def test_forced_tool_calls_of_the_default_model_follow_their_schemas(live_server, smol, parser: str) -> None:
    """tool_choice required and named, through the openai SDK, in each format: even a 135M model returns valid
    calls."""
    openai = pytest.importorskip("openai")
    server = live_server(create_app(smol[0], served_model_name="smol", llm=smol[1], tool_call_parser=parser))
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for i, choice in enumerate(["required", {"type": "function", "function": {"name": "get_time"}}] * 3):
        reply = sdk.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER, TIME], tool_choice=choice, temperature=0.8, seed=i, max_tokens=120,
            parallel_tool_calls=False)
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls" and len(message.tool_calls) == 1, reply
        call = message.tool_calls[0].function
        if isinstance(choice, dict):
            assert call.name == "get_time"
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])


def test_a_grammar_compiles_off_the_event_loop(smol) -> None:
    """The first grammar also builds llguidance's vocabulary (~0.5 s): AsyncLLM compiles on the core's compile
    threads and awaits the result, so that a server's event loop keeps answering and none of asyncio's default
    threads (chat templates, tokenizing) waits for a compile."""
    import asyncio
    import threading

    from pocketllm import SamplingParams
    from pocketllm.structured import StructuredOutputs
    from pocketllm.testing import engine_driver

    llm = smol[1]
    threads: list[str] = []
    grammars = engine_driver(llm).grammars
    compile = grammars._compile

    def spy(spec):
        threads.append(threading.current_thread().name)
        return compile(spec)

    choices = ["yes", "no", "off the loop"]

    async def run() -> str:
        params = SamplingParams(max_tokens=8, temperature=0, structured_outputs=StructuredOutputs(choice=choices))
        return "".join([e.text async for e in llm.stream_ids(llm.tokenizer.encode("Yes or no?"), params)])

    grammars._compile = spy
    try:
        assert asyncio.run(run()) in choices
    finally:
        del grammars._compile
    assert threads and all(name.startswith("pocketllm-grammar") for name in threads), threads
