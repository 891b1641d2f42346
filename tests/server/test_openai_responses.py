"""OpenAI's Responses API (/v1/responses) through the real `openai` SDK and the OpenAI Agents SDK against a real
server: the echo backend for shapes (its reply replays the prompt), the default model on cpp for forced function
calls and structured outputs."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from pocketllm import AsyncLLM, EngineArgs
from pocketllm.testing import StepGate
from pocketllm_server import create_app
from tests.server.conftest import LiveServer

MODEL = "tiny"
GREEDY = {"temperature": 0}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
CHAT_TOOLS = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]


def sdk_for(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def sdk(echo_server: LiveServer) -> Iterator[openai.OpenAI]:
    with sdk_for(echo_server) as client:
        yield client


def chat_reply(server: LiveServer, messages: list[dict], max_tokens: int, **extra: object) -> dict:
    """What /v1/chat/completions answers to the same conversation: the Responses route must say the same."""
    return httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": messages, "max_tokens": max_tokens, **GREEDY, **extra}).json()["choices"][0]


def test_text_response(sdk: openai.OpenAI, echo_server: LiveServer, echo_llm: AsyncLLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    _, prompt_ids = echo_llm.render_chat(messages)
    response = sdk.responses.create(model=MODEL, instructions="Be brief.", input="hello there", max_output_tokens=7,
                                    metadata={"k": "v"}, **GREEDY)
    assert response.object == "response" and response.model == MODEL and response.metadata == {"k": "v"}
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert response.output_text == chat_reply(echo_server, messages, 7)["message"]["content"]
    assert (response.usage.input_tokens, response.usage.output_tokens) == (len(prompt_ids), 7)
    assert response.usage.total_tokens == len(prompt_ids) + 7
    items = sdk.responses.create(model=MODEL, max_output_tokens=7, **GREEDY, input=[
        {"role": "system", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello "},
                                                         {"type": "input_text", "text": "there"}]}])
    assert items.output_text == response.output_text
    # The hosted service's settings are taken as the SDK sends them and change nothing here.
    hosted = sdk.responses.create(model=MODEL, instructions="Be brief.", input="hello there", max_output_tokens=7,
                                  max_tool_calls=1, service_tier="auto", prompt_cache_key="k", safety_identifier="u",
                                  **GREEDY)
    assert hosted.output_text == response.output_text


def test_streamed_events(sdk: openai.OpenAI) -> None:
    fields = {"model": MODEL, "input": "hi you", "max_output_tokens": 9, **GREEDY}
    whole = sdk.responses.create(**fields)
    events = list(sdk.responses.create(**fields, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == 9
    # The SDK's accumulating helper checks the events' order, and wants a completed response: a stop string ends
    # the echoed reply before max_output_tokens (stop is PocketLLM's extension here, as on chat completions).
    with sdk.responses.stream(**fields | {"max_output_tokens": 30}, extra_body={"stop": ["you"]}) as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "user\nhi "


def test_logprobs(torch_server: LiveServer) -> None:
    with sdk_for(torch_server) as client:
        response = client.responses.create(model=MODEL, input="hi you", max_output_tokens=4, top_logprobs=2,
                                           include=["message.output_text.logprobs"], **GREEDY)
    logprobs = response.output[0].content[0].logprobs
    assert "".join(lp.token for lp in logprobs) == response.output_text and len(logprobs) == 4
    assert all(len(lp.top_logprobs) == 2 for lp in logprobs)


@pytest.fixture(scope="module")
def hermes(tiny_hermes: Path, live_server) -> Iterator[tuple[LiveServer, AsyncLLM]]:
    llm = AsyncLLM(engine_args=EngineArgs(model=str(tiny_hermes), backend="echo"))
    yield live_server(create_app(llm.args, served_model_name=MODEL, llm=llm, max_stored_responses=2)), llm
    llm.shutdown()


def test_function_call_round_trip_with_previous_response_id(hermes: tuple[LiveServer, AsyncLLM]) -> None:
    """The echo backend replays a call the user wrote, which the template's parser reads back as a function_call
    item; its output continues the stored conversation, which renders as the whole OpenAI conversation did."""
    server, llm = hermes
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    with sdk_for(server) as client:
        first = client.responses.create(model=MODEL, input=call, tools=[WEATHER], max_output_tokens=200, **GREEDY)
        [fc] = [item for item in first.output if item.type == "function_call"]
        assert (fc.name, json.loads(fc.arguments)) == ("get_weather", {"city": "Paris", "unit": "celsius"})
        assert fc.call_id.startswith("call_") and fc.status == "completed"
        second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER],
                                         max_output_tokens=1, **GREEDY,
                                         input=[{"type": "function_call_output", "call_id": fc.call_id,
                                                 "output": "Sunny"}])
        assert second.previous_response_id == first.id
    message = [item for item in first.output if item.type == "message"]
    conversation = [{"role": "user", "content": call},
                    {"role": "assistant", "content": message[0].content[0].text if message else "",
                     "tool_calls": [{"id": fc.call_id, "type": "function",
                                     "function": {"name": fc.name, "arguments": fc.arguments}}]},
                    {"role": "tool", "tool_call_id": fc.call_id, "content": "Sunny"}]
    assert second.usage.input_tokens == len(llm.render_chat(conversation, tools=CHAT_TOOLS)[1])


def test_stored_responses(hermes: tuple[LiveServer, AsyncLLM]) -> None:
    """GET and DELETE of stored responses; store false keeps nothing; the least recently used of more than
    --max-stored-responses (2 here) is gone; an unknown id is a 404 with OpenAI's error body."""
    server, _ = hermes
    with sdk_for(server) as client:
        kept = client.responses.create(model=MODEL, input="one", max_output_tokens=2, **GREEDY)
        assert client.responses.retrieve(kept.id).output_text == kept.output_text
        unkept = client.responses.create(model=MODEL, input="two", max_output_tokens=2, store=False, **GREEDY)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unkept.id)
        client.responses.create(model=MODEL, input="three", max_output_tokens=2, **GREEDY)
        client.responses.create(model=MODEL, input="four", max_output_tokens=2, **GREEDY)
        with pytest.raises(openai.NotFoundError) as gone:
            client.responses.create(model=MODEL, input="x", previous_response_id=kept.id, **GREEDY)
        assert gone.value.body["code"] == "previous_response_not_found"
        assert gone.value.body["param"] == "previous_response_id"
        latest = client.responses.create(model=MODEL, input="five", max_output_tokens=2, **GREEDY)
        client.responses.delete(latest.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(latest.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(latest.id)
    missing = httpx.get(f"{server.url}/v1/responses/resp_nope", timeout=30)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"


def test_the_store_is_bounded_by_bytes(serve_app, tiny_args, echo_llm: AsyncLLM) -> None:
    app = create_app(tiny_args, served_model_name=MODEL, llm=echo_llm)
    store = app.state.server.responses
    with serve_app(app) as server, sdk_for(server) as client:
        small = client.responses.create(model=MODEL, input="short", max_output_tokens=2, **GREEDY)
        store.max_bytes = store.bytes + 100  # room for this one and a little more
        large = client.responses.create(model=MODEL, input="word " * 40, max_output_tokens=2, **GREEDY)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(large.id)  # larger than the whole bound: not kept
        assert client.responses.retrieve(small.id).id == small.id
        again = client.responses.create(model=MODEL, input="short", max_output_tokens=2, **GREEDY)
        assert client.responses.retrieve(again.id).id == again.id  # the least recently used made room
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(small.id)
    assert len(store) == 1 and store.bytes <= store.max_bytes


def test_errors_in_openai_s_shape(echo_server: LiveServer, echo_llm: AsyncLLM) -> None:
    url = f"{echo_server.url}/v1/responses"
    too_long = "word " * echo_llm.max_model_len
    for body, param in [({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                        ({"input": "hi", "background": True}, "background"),
                        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                         "input[0].content[0]"),
                        ({"input": [{"type": "computer_call_output", "call_id": "c", "output": {}}]},
                         "input[0].type"),
                        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
                        ({"input": "hi", "include": ["file_search_call.results"]}, "include"),
                        ({"input": "hi", "text": {"verbosity": "low"}}, "text.verbosity"),
                        ({"input": "hi", "metadata": {"k" * 65: "v"}}, "metadata"),
                        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
                        ({"input": "hi", "tools": [WEATHER | {"parameters": {"type": "banana"}}]},
                         "tools[0].parameters"),
                        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
                         "text.format.schema"),
                        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a b/c",
                                                             "schema": {"type": "object"}}}}, "text.format.name"),
                        # A prompt too long for the context names the longer of its two parts.
                        ({"input": "hi", "instructions": too_long}, "instructions"),
                        ({"input": too_long, "instructions": "Be brief."}, "input"),
                        ({"input": []}, "input"),
                        ({"input": "hi", "max_tool_calls": -1}, "max_tool_calls"),
                        ({"input": "hi", "max_tool_calls": 2**64}, "max_tool_calls"),
                        ({"input": "hi", "service_tier": "fastest"}, "service_tier"),
                        ({}, "input")]:
        response = httpx.post(url, json={"model": MODEL, **GREEDY, **body}, timeout=30)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, (body, response.json())


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_format(smol_server: LiveServer, stream: bool) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    fields = {"model": MODEL, "input": "Describe a person as JSON.", "max_output_tokens": 100, "temperature": 0.8,
              "text": {"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}}}
    with sdk_for(smol_server) as client:
        for seed in range(2):
            if stream:
                with client.responses.stream(**fields, extra_body={"seed": seed}) as s:
                    response = s.get_final_response()
            else:
                response = client.responses.create(**fields, extra_body={"seed": seed})
            jsonschema.validate(json.loads(response.output_text), schema)


def test_forced_function_call_and_its_stream(smol_server: LiveServer) -> None:
    fields = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [WEATHER], "max_output_tokens": 200,
              "tool_choice": {"type": "function", "name": "get_weather"}, **GREEDY}
    with sdk_for(smol_server) as client:
        whole = client.responses.create(**fields)
        [call] = [item for item in whole.output if item.type == "function_call"]
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
        events = list(client.responses.create(**fields, stream=True))
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments == call.arguments and done.name == "get_weather"
    assert events[-1].type == "response.completed"


def test_an_agent_with_one_function_tool(smol_server: LiveServer) -> None:
    """The OpenAI Agents SDK's default model path (the Responses API) runs an agent whose first turn must call
    the tool; the tool's result ends the run."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # its traces would go to OpenAI's servers
    asked: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"Sunny in {city}"

    client = openai.AsyncOpenAI(base_url=f"{smol_server.url}/v1", api_key="unused", max_retries=0)
    agent = agents.Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
                         model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0.0),
                         tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=2))
    assert len(asked) == 1 and result.final_output == f"Sunny in {asked[0]}"


def test_a_stream_cut_by_the_server_ends_with_an_error_and_a_failed_response(gated_server: LiveServer,
                                                                              gated_llm: AsyncLLM,
                                                                              gate: StepGate, wait_for) -> None:
    """An abort the client did not ask for (only a shutdown does that) ends the stream with an error event and
    response.failed; a client that leaves mid-stream frees its request."""
    gate.hold()
    gate.release(4)
    with sdk_for(gated_server) as client:
        stream = client.responses.create(model=MODEL, input="hello there", max_output_tokens=400, stream=True,
                                         **GREEDY)
        events = iter(stream)
        assert next(events).type == "response.created"
        gated_llm.abort(stream.response.headers["x-request-id"])
        *_, error, failed = list(events)
        stream.close()
    assert error.type == "error" and error.code == "request_aborted"
    assert failed.type == "response.failed" and failed.response.status == "failed"
    gate.release(8)
    with sdk_for(gated_server) as client:
        next(iter(client.responses.create(model=MODEL, input="hi", max_output_tokens=400, stream=True, **GREEDY)))
    assert wait_for(lambda: gated_llm.stats().num_running == gated_llm.stats().num_waiting == 0, timeout=2)


@pytest.fixture(scope="module")
def replay(tiny_with_template, live_server) -> Iterator[tuple[LiveServer, AsyncLLM]]:
    """An echo server whose template shows the last message's text alone (the reply is that text), splitting
    reasoning as Qwen3's replies open it."""
    llm = AsyncLLM(engine_args=EngineArgs(model=str(tiny_with_template("{{ messages[-1].content }}")),
                                          backend="echo"))
    yield live_server(create_app(llm.args, served_model_name=MODEL, llm=llm, reasoning_parser="qwen3")), llm
    llm.shutdown()


def test_reasoning_items(replay: tuple[LiveServer, AsyncLLM]) -> None:
    """With --reasoning-parser the reply's section is a reasoning item before the message, whole and streamed, and
    usage counts its tokens."""
    server, llm = replay
    text = "<think>a plan</think>The answer."
    fields = {"model": MODEL, "input": text, **GREEDY,
              "max_output_tokens": len(llm.tokenizer.encode(text, add_special_tokens=False))}
    with sdk_for(server) as client:
        whole = client.responses.create(**fields)
        events = list(client.responses.create(**fields, stream=True))
    reasoning, message = whole.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "a plan"
    assert message.type == "message" and whole.output_text == "The answer."
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "a plan"
    assert [item.type for item in events[-1].response.output] == ["reasoning", "message"]
