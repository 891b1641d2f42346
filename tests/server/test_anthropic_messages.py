"""Anthropic's Messages API (/v1/messages) through the real `anthropic` SDK against a real server: the echo backend
for shapes (its reply replays the prompt, so a template that shows only the last message makes the reply the
user's text), the default model on cpp for forced tool use."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest

from pocketllm import AsyncLLM, EngineArgs
from pocketllm.testing import StepGate
from pocketllm_server import create_app
from tests.server.conftest import LiveServer

anthropic = pytest.importorskip("anthropic")

MODEL = "tiny"
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Weather of a city", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}


def sdk_for(server: LiveServer, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def sdk(echo_server: LiveServer) -> Iterator[anthropic.Anthropic]:
    with sdk_for(echo_server) as client:
        yield client


@pytest.fixture(scope="module")
def replay(tiny_with_template, live_server) -> Iterator[tuple[anthropic.Anthropic, AsyncLLM]]:
    """An echo server whose template shows the last message's text alone: the reply is that text."""
    llm = AsyncLLM(engine_args=EngineArgs(model=str(tiny_with_template("{{ messages[-1].content }}")),
                                          backend="echo"))
    server = live_server(create_app(llm.args, served_model_name=MODEL, llm=llm, reasoning_parser="qwen3"))
    with sdk_for(server) as client:
        yield client, llm
    llm.shutdown()


def test_text_reply(sdk: anthropic.Anthropic, echo_llm: AsyncLLM) -> None:
    """system and messages render as the chat request would; the reply, usage and stop reason in Anthropic's shape."""
    _, prompt_ids = echo_llm.render_chat([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "hello there"}])
    message = sdk.messages.create(model=MODEL, max_tokens=7, system="Be brief.", extra_body=GREEDY,
                                  messages=[{"role": "user", "content": [{"type": "text", "text": "hello there"}]}])
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL
    assert message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text == echo_llm.tokenizer.decode([prompt_ids[i] for i in range(7)])
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert (message.usage.input_tokens, message.usage.output_tokens) == (len(prompt_ids), 7)


def test_streamed_text_equals_the_whole_reply(sdk: anthropic.Anthropic) -> None:
    fields = {"model": MODEL, "max_tokens": 9, "extra_body": GREEDY,
              "messages": [{"role": "user", "content": "hi you"}]}
    whole = sdk.messages.create(**fields)
    with sdk.messages.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-2:] == ["message_delta", "message_stop"]
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta")
    assert final.content[0].text == whole.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 9


def test_stop_sequences(replay: tuple[anthropic.Anthropic, AsyncLLM]) -> None:
    client, _ = replay
    for stream in (False, True):
        fields = {"model": MODEL, "max_tokens": 50, "extra_body": GREEDY, "stop_sequences": ["three", "zzz"],
                  "messages": [{"role": "user", "content": "one two three four"}]}
        if stream:
            with client.messages.stream(**fields) as s:
                message = s.get_final_message()
        else:
            message = client.messages.create(**fields)
        assert message.content[0].text == "one two " and message.stop_reason == "stop_sequence"
        assert message.stop_sequence == "three"


def test_thinking_blocks_with_the_reasoning_parser(replay: tuple[anthropic.Anthropic, AsyncLLM]) -> None:
    client, llm = replay
    text = "<think>a plan</think>The answer."
    fields = {"model": MODEL, "max_tokens": len(llm.tokenizer.encode(text, add_special_tokens=False)),
              "extra_body": GREEDY, "messages": [{"role": "user", "content": text}]}
    message = client.messages.create(**fields)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == [
        ("thinking", "a plan"), ("text", "The answer.")]
    with client.messages.stream(**fields) as s:
        streamed = s.get_final_message()
    assert [b.model_dump(exclude={"signature"}) for b in streamed.content] == [
        b.model_dump(exclude={"signature"}) for b in message.content]
    # The replayed template has no thinking switch, and this server splits reasoning: the model always thinks.
    with pytest.raises(anthropic.BadRequestError, match="no thinking switch"):
        client.messages.create(**fields, thinking={"type": "disabled"})


def test_thinking_on_a_model_that_does_not_think_is_refused(sdk: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as error:
        sdk.messages.create(model=MODEL, max_tokens=2000, thinking={"type": "enabled", "budget_tokens": 1024},
                            messages=[{"role": "user", "content": "hi"}])
    assert error.value.status_code == 400 and error.value.body["type"] == "error"
    assert error.value.body["error"]["type"] == "invalid_request_error"
    assert "budget_tokens" not in error.value.body["error"]["message"]


@pytest.mark.parametrize(("budget", "max_tokens"), [(10, 2048), (1023, 2048), (2048, 2048)])
def test_a_thinking_budget_is_checked_as_anthropic_checks_it(sdk: anthropic.Anthropic, budget: int,
                                                             max_tokens: int) -> None:
    """At least 1,024 tokens and fewer than max_tokens: refused so before anything about the model's thinking."""
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        sdk.messages.create(model=MODEL, max_tokens=max_tokens, thinking={"type": "enabled", "budget_tokens": budget},
                            messages=[{"role": "user", "content": "hi"}])


def test_the_model_in_anthropic_s_shape(sdk: anthropic.Anthropic, echo_llm: AsyncLLM) -> None:
    """Anthropic's Models API has OpenAI's paths (/v1/models): its clients, who send anthropic-version, get its
    shapes."""
    model = sdk.models.retrieve(MODEL)
    assert (model.type, model.id, model.display_name, model.lifecycle) == ("model", MODEL, MODEL, "active")
    assert model.created_at.tzinfo is not None and model.max_input_tokens == echo_llm.max_model_len
    assert [listed.id for listed in sdk.models.list()] == [MODEL]
    with pytest.raises(anthropic.NotFoundError) as error:
        sdk.models.retrieve("claude-x")
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tool_use(smol_server: LiveServer, stream: bool) -> None:
    """tool_choice naming a tool forces one call: a tool_use block whose input follows the schema."""
    with sdk_for(smol_server) as client:
        for seed in range(2):
            fields = {"model": MODEL, "max_tokens": 200, "tools": [WEATHER],
                      "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                      "messages": [{"role": "user", "content": "What is the weather in Paris?"}]}
            # temperature: no longer in the SDK's signature (newer Claude models fix it), still in the API's.
            extra = {"seed": seed, "temperature": 0.8}
            if stream:
                with client.messages.stream(**fields, extra_body=extra) as s:
                    message = s.get_final_message()
            else:
                message = client.messages.create(**fields, extra_body=extra)
            [call] = [b for b in message.content if b.type == "tool_use"]
            assert call.name == "get_weather" and call.id.startswith("toolu_") and message.stop_reason == "tool_use"
            jsonschema.validate(call.input, WEATHER["input_schema"])


def test_a_forced_call_cut_short_leaves_no_text(smol_server: LiveServer) -> None:
    """A forced call that max_tokens cut off is no call, and its unfinished text (the call format's) is no content
    either: nothing of the server's own format reaches the client."""
    with sdk_for(smol_server) as client:
        for stream in (False, True):
            fields = {"model": MODEL, "max_tokens": 5, "tools": [WEATHER], "tool_choice": {"type": "any"},
                      "messages": [{"role": "user", "content": "What is the weather in Paris?"}], "extra_body": GREEDY}
            if stream:
                with client.messages.stream(**fields) as s:
                    message = s.get_final_message()
            else:
                message = client.messages.create(**fields)
            assert message.stop_reason == "max_tokens" and message.content == [], message


@pytest.fixture(scope="module")
def hermes_server(tiny_hermes: Path, live_server) -> Iterator[tuple[LiveServer, AsyncLLM]]:
    llm = AsyncLLM(engine_args=EngineArgs(model=str(tiny_hermes), backend="echo"))
    yield live_server(create_app(llm.args, served_model_name=MODEL, llm=llm)), llm
    llm.shutdown()


def test_tool_result_round_trip(hermes_server: tuple[LiveServer, AsyncLLM]) -> None:
    """A tool_use turn and its tool_result render as the OpenAI conversation with the call and the tool message;
    the echo backend replays that prompt, so the reply shows what the model was given, and count_tokens counts it."""
    server, llm = hermes_server
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": [
                    {"type": "text", "text": "Let me look."},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                                             {"type": "text", "text": "Thanks."}]}]
    openai_form = [{"role": "user", "content": "Weather in Paris?"},
                   {"role": "assistant", "content": "Let me look.", "tool_calls": [
                       {"id": "toolu_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                   {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
                   {"role": "user", "content": "Thanks."}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "parameters": WEATHER["input_schema"],
                                                "description": WEATHER["description"]}}]
    _, ids = llm.render_chat(openai_form, tools=tools)
    with sdk_for(server) as client:
        counted = client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER])
        assert counted.input_tokens == len(ids)
        reply = client.messages.create(model=MODEL, max_tokens=len(ids), extra_body=GREEDY, messages=messages,
                                       tools=[WEATHER])
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "messages": openai_form, "tools": tools, "max_tokens": len(ids), "temperature": 0}).json()["choices"][0]
    # The reply replays the prompt, the earlier call included, which the hermes parser reads back as a call.
    assert reply.content[0].text == chat["message"]["content"] and "Sunny" in reply.content[0].text
    [call] = [(b.name, b.input) for b in reply.content if b.type == "tool_use"]
    assert call == ("get_weather", {"city": "Paris"}) and reply.stop_reason == "max_tokens"  # the prompt's length


def test_a_final_assistant_message_is_continued(sdk: anthropic.Anthropic, echo_server: LiveServer,
                                                echo_llm: AsyncLLM) -> None:
    """Anthropic's prefill: the reply continues the assistant's last words (no end of turn, no new generation
    prompt), on /v1/messages as on chat completions' continue_final_message."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is"}]
    text, ids = echo_llm.render_chat(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("The answer is")
    assert sdk.messages.count_tokens(model=MODEL, messages=messages).input_tokens == len(ids)
    reply = sdk.messages.create(model=MODEL, max_tokens=3, extra_body=GREEDY, messages=messages)
    assert reply.usage.input_tokens == len(ids)
    chat = httpx.post(f"{echo_server.url}/v1/chat/completions", timeout=30, json={
        "messages": messages, "max_tokens": 3, "add_generation_prompt": False, "continue_final_message": True,
        **GREEDY}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids) and chat["choices"][0]["message"]["content"] == \
        reply.content[0].text
    both = httpx.post(f"{echo_server.url}/v1/chat/completions", timeout=30, json={
        "messages": messages, "continue_final_message": True, **GREEDY})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_errors_in_anthropic_s_shape(echo_server: LiveServer, sdk: anthropic.Anthropic) -> None:
    url = f"{echo_server.url}/v1/messages"
    for body, status in [({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, 400),  # no max_tokens
                         ({"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, 400),
                         ({"model": MODEL, "max_tokens": 5, "messages": []}, 400),
                         ({"model": MODEL, "max_tokens": 5, "temperature": 1.5,
                           "messages": [{"role": "user", "content": "hi"}]}, 400),
                         ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": [
                             {"type": "image", "source": {"type": "base64", "data": "AA=="}}]}]}, 400),
                         ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                           "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400),
                         ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                           "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, 400),
                         ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": []}]}, 400),
                         ({"model": MODEL, "max_tokens": 5, "messages": [
                             {"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                             {"role": "user", "content": "go on"}]}, 400),
                         ({"model": "claude-x", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
                          404)]:
        response = httpx.post(url, json=body, timeout=30)
        assert response.status_code == status, (body, response.text)
        error = response.json()
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
        assert error["error"]["type"] == ("invalid_request_error" if status == 400 else "not_found_error")
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not supported"):
        sdk.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])
    with pytest.raises(anthropic.BadRequestError, match="non-empty content"):
        sdk.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": []}])
    with pytest.raises(anthropic.BadRequestError, match=r"tools\.1\.input_schema is not a JSON schema: type must be"):
        sdk.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}],
                            tools=[WEATHER, {"name": "f", "input_schema": {"type": "banana"}}])
    # The one message that may be empty: a final assistant one.
    reply = sdk.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY, messages=[
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": []}])
    assert reply.stop_reason == "max_tokens"


def test_api_key_as_x_api_key(serve_app, tiny_args, echo_llm) -> None:
    """--api-key takes Anthropic's x-api-key header as well as Authorization: Bearer; a wrong key is a 401 in
    Anthropic's shape."""
    app = create_app(tiny_args, served_model_name=MODEL, llm=echo_llm, api_key="sekret")
    with serve_app(app) as server:
        with sdk_for(server, "sekret") as client:
            assert client.messages.create(model=MODEL, max_tokens=2, extra_body=GREEDY,
                                          messages=[{"role": "user", "content": "hi"}]).content
        with sdk_for(server, "wrong") as client, pytest.raises(anthropic.AuthenticationError):
            client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        refused = httpx.post(f"{server.url}/v1/messages", json={}, timeout=30)
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
        bearer = httpx.post(f"{server.url}/v1/messages/count_tokens", headers={"Authorization": "Bearer sekret"},
                            json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0
        assert json.loads(httpx.get(f"{server.url}/v1/models", headers={"x-api-key": "sekret"}).text)["data"]


def test_a_stream_cut_by_the_server_ends_with_an_error_event(gated_server: LiveServer, gated_llm: AsyncLLM,
                                                              gate: StepGate, wait_for) -> None:
    """An abort the client did not ask for (only a shutdown does that) ends the stream with Anthropic's error event;
    a client that leaves mid-stream frees its request."""
    gate.hold()
    gate.release(4)
    body = {"model": MODEL, "max_tokens": 400, "stream": True, **GREEDY,
            "messages": [{"role": "user", "content": "hello there"}]}
    with httpx.stream("POST", f"{gated_server.url}/v1/messages", json=body) as response:
        lines = response.iter_lines()
        assert next(lines) == "event: message_start"
        gated_llm.abort(response.headers["x-request-id"])
        *_, name, data = [line for line in lines if line]
    assert name == "event: error" and json.loads(data.removeprefix("data: "))["error"]["type"] == "overloaded_error"
    gate.release(8)
    with httpx.stream("POST", f"{gated_server.url}/v1/messages", json=body) as response:
        assert next(response.iter_lines()) == "event: message_start"
    assert wait_for(lambda: gated_llm.stats().num_running == gated_llm.stats().num_waiting == 0, timeout=2)
