"""Tool-call parsers over scripted replies (calls split across pieces, several calls, malformed calls kept as
content, streams reassembling to the whole reply's parse), over HTTP with the echo backend, and forcing grammars
(what they admit, matched by llguidance; forced calls of the default model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pydantic
import pytest

from pocketllm import AsyncLLM, EngineArgs
from pocketllm_server import create_app
from pocketllm_server.tool_calls import ToolCallStream, parse, parser_for_template

jsonschema = pytest.importorskip("jsonschema")

HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>')
XML = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
       "</parameter>\n</function>\n</tool_call>")
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "f", "parameters": {}}'
GENERIC = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": "{}"}]}'


def calls_of(parser: str, text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = parse(parser, text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_each_format_parses() -> None:
    assert calls_of("hermes", HERMES) == ("Let me look.\n\n", [("get_weather", {"city": "Paris"}),
                                                              ("get_time", {"zone": "CET"})])
    assert calls_of("qwen3_xml", XML) == ("", [("get_weather", {"city": "Paris", "days": 3})])
    assert calls_of("llama3_json", LLAMA) == ("", [("get_weather", {"city": "Paris"}), ("f", {})])
    assert calls_of("generic", GENERIC) == ("", [("get_weather", {"city": "Paris"}), ("f", {})])
    assert calls_of("generic", ' {"tool_call": {"name": "f", "arguments": {"x": 1}}}\n') == ("", [("f", {"x": 1})])
    assert calls_of("generic", '{"response": "Hi there."}') == ("Hi there.", [])


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", "<tool_call>{not json</tool_call> sorry"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("qwen3_xml", "<tool_call><parameter=x>1</parameter></tool_call>"),  # no function
    ("llama3_json", '{"name": "f", "parameters": {}} and then some prose'),
    ("llama3_json", "Plain prose."),
    ("generic", "Plain prose."),
    ("generic", '{"tool_call": {"arguments": {}}}'),  # no name
    ("generic", '{"tool_calls": [{"name": "f", "arguments": {}}, 3]}'),  # one of them malformed
    ("generic", '{"answer": 42}'),  # JSON, but no call and no response
])
def test_malformed_calls_stay_content(parser: str, text: str) -> None:
    assert parse(parser, text) == (text, [])


@pytest.mark.parametrize("parser", ["hermes", "qwen3_xml", "llama3_json", "generic"])
@pytest.mark.parametrize("size", [1, 3, 8])
def test_streams_reassemble_to_the_whole_parse(parser: str, size: int) -> None:
    text = {"hermes": HERMES, "qwen3_xml": "Sure. " + XML, "llama3_json": LLAMA, "generic": GENERIC}[parser]
    stream = ToolCallStream(parser)
    content = "".join(stream.feed(text[i:i + size]) for i in range(0, len(text), size))
    rest, calls = stream.finish()
    whole_content, whole_calls = parse(parser, text)
    assert content + rest == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]


def test_auto_picks_the_template_s_format() -> None:
    assert parser_for_template("{{ '<tool_call>' }}{{ '<function=' }}") == "qwen3_xml"
    assert parser_for_template("<tool_call>{{ tool | tojson }}</tool_call>") == "hermes"
    assert parser_for_template("{% if role == 'ipython' %}") == "llama3_json"
    assert parser_for_template("{{ messages }}") is None


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def hermes_llm(tiny_hermes: Path) -> Iterator[AsyncLLM]:
    """The echo backend on the tiny checkpoint with a template in the hermes format."""
    llm = AsyncLLM(engine_args=EngineArgs(model=str(tiny_hermes), backend="echo"))
    yield llm
    llm.shutdown()


def test_calls_over_http(serve_app, hermes_llm: AsyncLLM) -> None:
    """The echo backend replays the rendered prompt: a user turn holding a call scripts the reply."""
    app = create_app(hermes_llm.args, served_model_name="tiny", llm=hermes_llm, tool_call_parser="hermes")
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    body = {"messages": [{"role": "user", "content": call * 2}], "max_tokens": 200, "temperature": 0,
            "tools": TOOLS}
    with serve_app(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        reply = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        calls = reply["message"]["tool_calls"]
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
            ("get_weather", {"city": "Paris"})] * 2
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
        one = client.post("/v1/chat/completions", json=body | {"parallel_tool_calls": False}).json()
        assert len(one["choices"][0]["message"]["tool_calls"]) == 1
        none = client.post("/v1/chat/completions", json=body | {"tool_choice": "none"}).json()
        assert none["choices"][0]["message"]["tool_calls"] == [] and call in none["choices"][0]["message"]["content"]
        legacy = {k: v for k, v in body.items() if k != "tools"} | {"functions": [TOOLS[0]["function"]]}
        message = client.post("/v1/chat/completions", json=legacy).json()["choices"][0]["message"]
        call = message["function_call"]  # one: the legacy API has no parallel calls
        assert message["tool_calls"] == [] and (call["name"], json.loads(call["arguments"])) == (
            "get_weather", {"city": "Paris"})
        streamed: dict[int, dict[str, str]] = {}
        finish = None
        with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    for delta in choice["delta"].get("tool_calls") or []:
                        entry = streamed.setdefault(delta["index"], {"name": "", "arguments": ""})
                        entry["name"] += delta["function"].get("name") or ""
                        entry["arguments"] += delta["function"].get("arguments") or ""
                    finish = choice["finish_reason"] or finish
        assert [(v["name"], json.loads(v["arguments"])) for v in streamed.values()] == [
            ("get_weather", {"city": "Paris"})] * 2
        assert finish == reply["finish_reason"] and finish in ("tool_calls", "length")
        assert client.post("/v1/chat/completions", json=body | {"tool_choice": "required"}).status_code == 400
        assert client.post("/v1/chat/completions", json=legacy | {"function_call": {"name": "x"}}).status_code == 400


def test_the_default_parser_is_the_template_s(serve_app, hermes_llm: AsyncLLM) -> None:
    """A server started without --tool-call-parser (auto, the default) parses calls in the format its template
    shows."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "P"}}</tool_call>'
    messages = [{"role": "user", "content": call}]
    _, prompt_ids = hermes_llm.render_chat(messages, tools=TOOLS)
    body = {"messages": messages, "tools": TOOLS, "max_tokens": len(prompt_ids), "temperature": 0}
    with serve_app(create_app(hermes_llm.args, served_model_name="tiny", llm=hermes_llm)) as server:
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).json()["choices"][0]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in reply["message"]["tool_calls"]] \
        == [("get_weather", {"city": "P"})]


def reply_of(client: httpx.Client, body: dict, stream: bool) -> tuple[str, list[tuple[str, dict]]]:
    """A chat reply's content and calls (name, arguments), streamed and reassembled or not."""
    if not stream:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        return message["content"] or "", [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                                          for c in message["tool_calls"]]
    content, calls = "", {}
    with client.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                content += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    entry = calls.setdefault(call["index"], ["", ""])
                    entry[0] += call["function"].get("name") or ""
                    entry[1] += call["function"].get("arguments") or ""
    return content, [(name, json.loads(arguments)) for name, arguments in calls.values()]


def test_a_template_that_ignores_tools_gets_them_in_a_system_message(serve_app, tiny_args, echo_llm) -> None:
    """The kit's template drops tools, as the default model's does: they go in a system message that asks for the
    generic JSON format (llama.cpp's fallback), which the echo backend replays; not under tool_choice none."""
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS, "max_tokens": 100,
            "temperature": 0}
    with serve_app(create_app(tiny_args, served_model_name="tiny", llm=echo_llm)) as server, \
            httpx.Client(base_url=server.url, timeout=30) as client:
        assert reply_of(client, body, False)[0].startswith(
            'system\nYou can call these tools: [{"type": "function", "function": {"name": "get_weather"')
        assert reply_of(client, body | {"tool_choice": "none"}, False)[0].startswith("user\nWeather in Paris?")


@pytest.mark.parametrize("parser", ["auto", "generic"])
@pytest.mark.parametrize("stream", [False, True])
def test_generic_replies_are_read_back(serve_app, tiny_with_template, parser: str, stream: bool) -> None:
    """Where the template ignores tools, replies are parsed in the generic format that its stand-in system message
    asks for (auto, the default, picks it). This template shows only the last message, so the echo backend
    replays the user's text as the reply."""
    llm = AsyncLLM(engine_args=EngineArgs(model=str(tiny_with_template("{{ messages[-1].content }}")),
                                          backend="echo"))
    try:
        with serve_app(create_app(llm.args, served_model_name="tiny", llm=llm, tool_call_parser=parser)) as server, \
                httpx.Client(base_url=server.url, timeout=30) as client:
            call = '{"tool_call": {"name": "get_weather", "arguments": {"city": "P"}}}'
            for text, expected in [(call, ("", [("get_weather", {"city": "P"})])), ('{"response": "Hi."}', ("Hi.", [])),
                                   ("Plain text.", ("Plain text.", []))]:
                body = {"messages": [{"role": "user", "content": text}], "tools": TOOLS, "temperature": 0,
                        "max_tokens": len(llm.tokenizer.encode(text, add_special_tokens=False))}
                assert reply_of(client, body, stream) == expected
    finally:
        llm.shutdown()


@pytest.mark.parametrize("parser", ["hermes", "qwen3_xml", "llama3_json", "generic"])
def test_a_forcing_grammar_refuses_parameters_that_are_no_schema(parser: str) -> None:
    from pocketllm_server.tool_calls import forcing_grammar

    with pytest.raises(ValueError, match="parameters must be a JSON schema object"):
        forcing_grammar(parser, [{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, False)


@pytest.fixture(scope="module")
def smol() -> Iterator[tuple[EngineArgs, AsyncLLM]]:
    """The default model on the cpp backend (what ``auto`` picks on x86 CPUs), which has grammars."""
    pytest.importorskip("pocketllm_cpp")
    args = EngineArgs(model="smollm2-135m-instruct", backend="cpp")
    llm = AsyncLLM(engine_args=args)
    yield args, llm
    llm.shutdown()


class Address(pydantic.BaseModel):
    street: str = pydantic.Field(max_length=30)
    city: str = pydantic.Field(max_length=20)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    address: Address
    pets: list[Address] = pydantic.Field(max_length=2)


class Node(pydantic.BaseModel):  # recursive: pydantic writes {"$defs": {"Node": ...}, "$ref": "#/$defs/Node"}
    model_config = pydantic.ConfigDict(extra="forbid")
    label: str = pydantic.Field(max_length=10)
    children: list[Node] = pydantic.Field(default=[], max_length=1)


PYDANTIC_TOOLS = [openai.pydantic_function_tool(Person, name="add_person"),
                  {"type": "function", "function": {"name": "add_tree", "parameters": Node.model_json_schema()}}]


def matched(llm: AsyncLLM, grammar: str, text: str) -> Any:
    """llguidance's matcher for ``grammar`` once it has taken ``text``'s tokens, as it takes a reply's."""
    import llguidance

    tokenizer = llguidance.LLTokenizer(llm.tokenizer.backend.to_str(), eos_token=list(llm.tokenizer.eos_token_ids))
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    matcher.consume_tokens(tokenizer.tokenize_str(text))
    return matcher


def admits(llm: AsyncLLM, grammar: str, text: str) -> bool:
    """Whether ``grammar`` takes the whole of ``text``."""
    matcher = matched(llm, grammar, text)
    return not matcher.is_error() and matcher.is_accepting()


def spelled(parser: str, name: str, arguments: dict, times: int = 1, parallel: bool = False) -> str:
    """A reply of ``times`` calls as each forcing grammar spells them (no whitespace inside the arguments; in the
    generic format, a list of calls where they may be several)."""
    compact = {key: json.dumps(value, separators=(",", ":")) for key, value in arguments.items()}
    if parser == "qwen3_xml":
        parameters = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in compact.items())
        return "\n".join([f"<tool_call>\n<function={name}>\n{parameters}</function>\n</tool_call>"] * times)
    key = "parameters" if parser == "llama3_json" else "arguments"
    call = f'{{"name": "{name}", "{key}": {json.dumps(arguments, separators=(",", ":"))}}}'
    if parser == "generic":
        return f'{{"tool_calls": [{", ".join([call] * times)}]}}' if parallel else f'{{"tool_call": {call}}}'
    if parser == "llama3_json":
        return "; ".join([call] * times)
    return "\n".join([f"<tool_call>\n{call}\n</tool_call>"] * times)


@pytest.mark.parametrize("parser", ["hermes", "qwen3_xml", "llama3_json", "generic"])
def test_forcing_grammars_follow_references(echo_llm: AsyncLLM, parser: str) -> None:
    """References resolve against the parameters schema's root, as the client wrote them: into $defs, and from a
    reference at the root (a recursive model); what they describe is enforced, not skipped."""
    from pocketllm_server.tool_calls import forcing_grammar

    person = forcing_grammar(parser, PYDANTIC_TOOLS, "add_person", False)
    ann = {"name": "Ann", "address": {"street": "1 Main St", "city": "Paris"}, "pets": []}
    assert admits(echo_llm, person, spelled(parser, "add_person", ann))
    assert not admits(echo_llm, person, spelled(parser, "add_person", ann | {"address": {"street": "1 Main St"}}))
    tree = forcing_grammar(parser, PYDANTIC_TOOLS, "add_tree", False)
    assert admits(echo_llm, tree, spelled(parser, "add_tree", {"label": "a", "children": [
        {"label": "b", "children": [{"label": "c"}]}]}))
    assert not admits(echo_llm, tree, spelled(parser, "add_tree", {"label": "a", "children": [{"label": 1}]}))


@pytest.mark.parametrize("parser", ["hermes", "qwen3_xml", "llama3_json"])
def test_forced_calls_take_pydantic_schemas(serve_app, smol, parser: str) -> None:
    """The openai SDK's pydantic_function_tool (as instructor, LangChain and the Agents SDK) writes nested models
    as $defs with #/$defs/X references: the default model's forced call follows them."""
    schema = PYDANTIC_TOOLS[0]["function"]["parameters"]
    with serve_app(create_app(smol[0], served_model_name="smol", llm=smol[1], tool_call_parser=parser)) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as sdk:
        for seed in range(2):
            reply = sdk.chat.completions.create(
                model="smol", messages=[{"role": "user", "content": "Add Ann, who lives at 1 Main St in Paris."}],
                tools=PYDANTIC_TOOLS, tool_choice={"type": "function", "function": {"name": "add_person"}},
                temperature=0.8, seed=seed, max_tokens=200, parallel_tool_calls=False)
            [call] = reply.choices[0].message.tool_calls
            assert call.function.name == "add_person" and reply.choices[0].finish_reason == "tool_calls", reply
            jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("parser", ["hermes", "qwen3_xml", "llama3_json", "generic"])
def test_a_forcing_grammar_admits_one_call_unless_parallel(echo_llm: AsyncLLM, parser: str) -> None:
    from pocketllm_server.tool_calls import forcing_grammar

    one_only, several = (forcing_grammar(parser, TOOLS, "get_weather", parallel) for parallel in (False, True))
    assert admits(echo_llm, one_only, spelled(parser, "get_weather", {"city": "Paris"}))
    assert matched(echo_llm, one_only, spelled(parser, "get_weather", {"city": "Paris"})).is_stopped()  # EOS only
    for times in (2, 3):
        assert not admits(echo_llm, one_only, spelled(parser, "get_weather", {"city": "Paris"}, times, True))
    for times in (1, 3):
        assert admits(echo_llm, several, spelled(parser, "get_weather", {"city": "Paris"}, times, True))


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_without_parallel_tool_calls_is_one_call(serve_app, smol, stream: bool) -> None:
    """A named tool_choice and no parallel_tool_calls (the SDK sends none): one call, then the reply ends. The
    default model used to call again and again (3 and 6 calls at these seeds)."""
    with serve_app(create_app(smol[0], served_model_name="smol", llm=smol[1], tool_call_parser="hermes")) as server, \
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as sdk:
        for seed in range(2):
            fields = {"model": "smol", "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
                      "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                      "temperature": 0.8, "seed": seed, "max_tokens": 200}
            if stream:
                chunks = list(sdk.chat.completions.create(**fields, stream=True))
                deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
                assert {d.index for d in deltas} == {0} and chunks[-1].choices[0].finish_reason == "tool_calls"
                continue
            reply = sdk.chat.completions.create(**fields)
            [call] = reply.choices[0].message.tool_calls
            assert call.function.name == "get_weather" and reply.choices[0].finish_reason == "tool_calls", reply
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
