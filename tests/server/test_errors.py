"""Every client mistake is a 4xx with an OpenAI error body naming the field; surprises are 500s that stay contained."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
from typing import Any

import httpx
import pytest

from pocketllm import AsyncLLM, PromptTooLongError
from pocketllm.testing import StepGate
from pocketllm_server import create_app

MODEL = "tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
JSON = {"content-type": "application/json"}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 4, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "temperature": 0, "max_tokens": 4, **fields}


def assert_error(response: httpx.Response, status: int, param: str | None, *, code: str | None = None,
                 type_: str = "invalid_request_error") -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == type_
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code
    return error


def test_malformed_json(client: httpx.Client) -> None:
    for path in (CHAT, COMPLETIONS, "/tokenize", "/detokenize"):
        response = client.post(path, content=b'{"model": "tiny", "messages": [',
                               headers={"content-type": "application/json"})
        assert "JSON" in assert_error(response, 400, None)["message"]


def test_a_lone_surrogate_escape_is_named(client: httpx.Client) -> None:
    """json.dumps writes half a UTF-16 surrogate pair as a lone \\u escape, whose high half msgspec took for a body
    cut short; an escaped backslash before "ud800" is text."""
    for text in ("a\ud800b", "\udc00", "\U0001f600\ud800"):
        body = json.dumps(chat(messages=[{"role": "user", "content": text}]))
        escape = next(f"\\u{ord(c):04x}" for c in text if 0xD800 <= ord(c) < 0xE000)
        error = assert_error(client.post(CHAT, content=body, headers=JSON), 400, None)
        assert f"invalid unicode escape {escape} at byte {body.index(escape)}" in error["message"], error
    assert client.post(CHAT, content=json.dumps(chat(messages=[{"role": "user", "content": "\\ud800"}])),
                       headers=JSON).status_code == 200
    # An earlier mistake is the one reported.
    error = assert_error(client.post(CHAT, content=b'{"n": , "x": "\\ud800"}', headers=JSON), 400, None)
    assert "invalid character (byte 6)" in error["message"], error


def test_body_must_be_an_object(client: httpx.Client) -> None:
    assert_error(client.post(CHAT, json=[1, 2]), 400, None)


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, {"model": MODEL}, "messages"),
    (CHAT, chat(messages="hi"), "messages"),
    (CHAT, chat(messages=[{"content": "hi"}]), "messages[0].role"),
    (CHAT, chat(messages=[{"role": "user", "content": 3}]), "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0]"),
    (CHAT, chat(n="2"), "n"),
    (CHAT, chat(temperature="hot"), "temperature"),
    (CHAT, chat(stream="yes"), "stream"),
    (CHAT, chat(stop=3), "stop"),
    (CHAT, chat(logprobs=2), "logprobs"),
    (CHAT, chat(max_tokens=True), "max_tokens"),
    (COMPLETIONS, {"model": MODEL}, "prompt"),
    (COMPLETIONS, completion(prompt={"text": "hi"}), "prompt"),
    (COMPLETIONS, completion(prompt=[1, [2, "x"]]), "prompt[1][1]"),
    (COMPLETIONS, completion(logit_bias={"5": "high"}), "logit_bias"),
    (COMPLETIONS, completion(echo=1), "echo"),
])
def test_wrong_types_name_the_field(client: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    assert_error(client.post(path, json=body), 400, param)


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, chat(max_tokens=0), "max_tokens"),
    (CHAT, chat(max_tokens=-5), "max_tokens"),
    (CHAT, chat(max_tokens=None, max_completion_tokens=0), "max_completion_tokens"),
    (COMPLETIONS, completion(max_tokens=0), "max_tokens"),
    (CHAT, chat(n=0), "n"),
    (CHAT, chat(n=17), "n"),
    (COMPLETIONS, completion(n=-1), "n"),
    (CHAT, chat(temperature=-0.1), "temperature"),
    (CHAT, chat(temperature=2.5), "temperature"),
    (COMPLETIONS, completion(temperature=3), "temperature"),
    (CHAT, chat(top_p=0), "top_p"),
    (CHAT, chat(top_k=-2), "top_k"),
    (CHAT, chat(min_p=1.5), "min_p"),
    (CHAT, chat(presence_penalty=3), "presence_penalty"),
    (CHAT, chat(frequency_penalty=-3), "frequency_penalty"),
    (CHAT, chat(repetition_penalty=0), "repetition_penalty"),
    (CHAT, chat(min_tokens=10), "min_tokens"),
    (CHAT, chat(top_logprobs=21, logprobs=True), "top_logprobs"),
    (CHAT, chat(top_logprobs=2), "top_logprobs"),
    (COMPLETIONS, completion(logprobs=21), "logprobs"),
    (CHAT, chat(stop=[""]), "stop"),
    (CHAT, chat(stop_token_ids=[-1]), "stop_token_ids"),
    (CHAT, chat(logit_bias={"abc": 1}), "logit_bias"),
    (CHAT, chat(logit_bias={"100000": 1}), "logit_bias"),
    (CHAT, chat(logit_bias={"5": 101}), "logit_bias"),
    (CHAT, chat(stream_options={"include_usage": True}), "stream_options"),
    (CHAT, chat(messages=[]), "messages"),
    (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    (CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), "messages"),
    (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "a b/c", "schema": {}}}),
     "response_format.json_schema.name"),
    # Tools as OpenAI takes them, under tool_choice auto (the default) too.
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": "notaschema"}}]),
     "tools[0].function.parameters"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}},
                       {"type": "function", "function": {"name": "g", "parameters": {"type": "banana"}}}]),
     "tools[1].function.parameters"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": "x"}}}]),
     "tools[0].function.parameters"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "items": {"anyOf": "x"}}}}}}]),
     "tools[0].function.parameters"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"required": "a"}}}]),
     "tools[0].function.parameters"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}] * 2), "tools"),
    (CHAT, chat(tools=[{"type": "function"}]), "tools[0]"),
    (CHAT, chat(messages=[{"role": "user", "content": "hi"}, {"role": "tool", "content": "11 degrees"}]),
     "messages[1].tool_call_id"),
    (COMPLETIONS, completion(prompt=[]), "prompt"),
    (COMPLETIONS, completion(prompt=["a", [1, 2]]), "prompt"),
    (COMPLETIONS, completion(prompt=[1, 99999]), "prompt"),
    (COMPLETIONS, completion(prompt=""), "prompt"),
])
def test_bad_values_are_400s_naming_the_field(client: httpx.Client, path: str, body: dict[str, Any],
                                              param: str) -> None:
    assert_error(client.post(path, json=body), 400, param)


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, chat(response_format={"type": "json_object"}), "response_format"),
    # Forced calls need a backend with grammars (echo has none).
    (CHAT, chat(tool_choice="required", tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice"),
    (CHAT, chat(audio={"voice": "alloy", "format": "wav"}), "audio"),
    (CHAT, chat(modalities=["text", "audio"]), "modalities"),
    (CHAT, chat(prediction={"type": "content", "content": "x"}), "prediction"),
    (COMPLETIONS, completion(suffix="x"), "suffix"),
    (COMPLETIONS, completion(best_of=3), "best_of"),
    # vLLM's extras this server lacks: refused by name, where an unknown field would be dropped without a word.
    (CHAT, chat(allowed_token_ids=[28, 29]), "allowed_token_ids"),
    (COMPLETIONS, completion(bad_words=["hello"]), "bad_words"),
    (CHAT, chat(use_beam_search=True, n=2), "use_beam_search"),
    (COMPLETIONS, completion(truncate_prompt_tokens=2), "truncate_prompt_tokens"),
    (CHAT, chat(typical_p=0.5), "typical_p"),
    (COMPLETIONS, completion(logits_processors=["x"]), "logits_processors"),
    (CHAT, chat(logprobs=True, return_tokens_as_token_ids=True), "return_tokens_as_token_ids"),
    (CHAT, chat(reasoning_effort="high"), "reasoning_effort"),
    (CHAT, chat(chat_template="{{ 'XYZ' }}"), "chat_template"),
    (CHAT, chat(echo=True), "echo"),
    (CHAT, chat(prompt_logprobs=2), "prompt_logprobs"),
])
def test_unsupported_features_are_400s(client: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    assert_error(client.post(path, json=body), 400, param, code="unsupported_option")


@pytest.mark.parametrize(("path", "body", "param"), [
    (CHAT, chat(temperature=0.7), "temperature"),
    (COMPLETIONS, completion(temperature=1.0), "temperature"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hello", "max_tokens": 4}, "temperature"),  # OpenAI's default is 1
    (CHAT, chat(logprobs=True), "logprobs"),
    (COMPLETIONS, completion(logprobs=1), "logprobs"),
    (COMPLETIONS, completion(prompt_logprobs=1), "prompt_logprobs"),
    (COMPLETIONS, completion(max_tokens=0, echo=True), "prompt_logprobs"),  # scoring a prompt is prompt logprobs
])
def test_options_the_backend_lacks_are_400s_naming_them(client: httpx.Client, path: str, body: dict[str, Any],
                                                         param: str) -> None:
    error = assert_error(client.post(path, json=body), 400, param, code="unsupported_option")
    assert "echo" in error["message"] and param in error["message"]


def test_extras_at_their_neutral_values_are_accepted(client: httpx.Client) -> None:
    """A client that sends vLLM's extras at the values that ask for nothing (as some do by default) is served."""
    body = chat(use_beam_search=False, length_penalty=1.0, typical_p=1.0, echo=False,
                return_tokens_as_token_ids=False, allowed_token_ids=None)
    assert client.post(CHAT, json=body).status_code == 200


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_streaming_errors_come_before_the_stream(client: httpx.Client, path: str) -> None:
    body = (chat if path == CHAT else completion)(stream=True, temperature=1.0)
    with client.stream("POST", path, json=body) as response:
        response.read()
    assert_error(response, 400, "temperature", code="unsupported_option")


def test_unknown_model_is_404(client: httpx.Client) -> None:
    for path, body in ((CHAT, chat(model="gpt-4")), (COMPLETIONS, completion(model="gpt-4")),
                       ("/tokenize", {"model": "gpt-4", "prompt": "x"})):
        error = assert_error(client.post(path, json=body), 404, "model", code="model_not_found")
        assert "gpt-4" in error["message"]


def test_model_may_be_left_out(client: httpx.Client) -> None:
    body = completion()
    del body["model"]
    assert client.post(COMPLETIONS, json=body).status_code == 200


def test_prompt_longer_than_the_context(client: httpx.Client, echo_llm: AsyncLLM) -> None:
    max_model_len = echo_llm.args.max_model_len
    assert max_model_len is not None
    too_long = [5] * max_model_len
    assert_error(client.post(COMPLETIONS, json=completion(prompt=too_long)), 400, "prompt",
                 code="context_length_exceeded")
    # The prompt fits, but not with the completion asked for.
    error = assert_error(client.post(COMPLETIONS, json=completion(prompt=[5] * 100, max_tokens=max_model_len)), 400,
                         "max_tokens", code="context_length_exceeded")
    assert str(max_model_len) in error["message"]
    long_message = [{"role": "user", "content": "a " * max_model_len}]
    assert_error(client.post(CHAT, json=chat(messages=long_message, max_tokens=None)), 400, "messages",
                 code="context_length_exceeded")
    assert_error(client.post(CHAT, json=chat(max_completion_tokens=max_model_len, max_tokens=None)), 400,
                 "max_completion_tokens", code="context_length_exceeded")


def test_engine_prompt_too_long_error_is_a_400(client: httpx.Client, echo_llm: AsyncLLM,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend may refuse a prompt the server's own check let through (e.g. KV cache too small)."""
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PromptTooLongError("prompt does not fit in the KV cache")

    monkeypatch.setattr(echo_llm.backend_engine, "add_request", refuse)
    assert_error(client.post(COMPLETIONS, json=completion()), 400, "prompt", code="context_length_exceeded")
    assert_error(client.post(CHAT, json=chat()), 400, "messages", code="context_length_exceeded")


def test_clients_may_send_the_same_request_id_at_once(gated_server, gate: StepGate) -> None:
    """40 requests in flight together, 34 with X-Request-Id "coll" (3 of them two-prompt batches, whose engine
    requests were once "coll-0" and "coll-1") and 6 with "coll-1": all 200, each with its own body id and the
    client's id in its header. The engine used to be keyed by the client's ids: 35 of 40 were refused."""
    sent = [("coll", completion())] * 31 + [("coll", completion(prompt=["a", "b"]))] * 3
    sent += [("coll-1", completion())] * 6
    gate.hold()  # no request ends before every one of them is in the engine

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gated_server.url, timeout=60,
                                     limits=httpx.Limits(max_connections=64)) as http:
            requests = asyncio.gather(*(http.post(COMPLETIONS, json=body, headers={"X-Request-Id": client_id})
                                        for client_id, body in sent))
            try:
                assert await asyncio.to_thread(gate.wait_added, len(sent) + 3), \
                    f"{len(gate.added)} of {len(sent) + 3} added"
            finally:
                gate.open()
            return await requests

    responses = asyncio.run(main())
    assert [(r.status_code, r.headers["x-request-id"]) for r in responses] == [(200, i) for i, _ in sent]
    engine_ids = gate.added
    assert len({r.json()["id"] for r in responses}) == len(sent) and len(set(engine_ids)) == len(engine_ids)


def test_routing_errors_use_the_error_shape(client: httpx.Client) -> None:
    assert_error(client.post("/v1/nope", json={}), 404, None)
    assert_error(client.get(CHAT), 405, None)


def test_request_id_header(client: httpx.Client) -> None:
    """The client's X-Request-Id comes back in the header, errors included; the body's id is the server's own."""
    response = client.post(CHAT, json=chat(), headers={"X-Request-Id": "my-request-1"})
    assert response.headers["x-request-id"] == "my-request-1" and response.json()["id"].startswith("chatcmpl-")
    generated = client.post(COMPLETIONS, json=completion())
    assert generated.headers["x-request-id"] == generated.json()["id"]
    assert generated.json()["id"].startswith("cmpl-")
    with client.stream("POST", CHAT, json=chat(stream=True), headers={"X-Request-Id": "stream-1"}) as streamed:
        assert streamed.headers["x-request-id"] == "stream-1"
        assert '"id":"chatcmpl-' in streamed.read().decode()
    for refused in (client.post(CHAT, json=chat(temperature=-1), headers={"X-Request-Id": "bad-1"}),
                    client.get("/nope", headers={"X-Request-Id": "bad-1"})):
        assert refused.status_code in (400, 404) and refused.headers["x-request-id"] == "bad-1"


def test_unexpected_exception_is_a_contained_500(client: httpx.Client, echo_llm: AsyncLLM,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    render = echo_llm.render_chat

    def explode_on_boom(messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        if messages[0]["content"] == "boom":
            raise RuntimeError("a bug")
        return render(messages, **kwargs)

    monkeypatch.setattr(echo_llm, "render_chat", explode_on_boom)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        good = [pool.submit(client.post, CHAT, json=chat(stream=stream)) for stream in (False, True)]
        bad = client.post(CHAT, json=chat(messages=[{"role": "user", "content": "boom"}]))
        assert_error(bad, 500, None, type_="internal_server_error")
        assert "a bug" not in bad.text  # internals stay in the log
        [record] = [r for r in caplog.records if r.name == "pocketllm_server" and r.levelname == "ERROR"]
        assert "POST /v1/chat/completions" in record.getMessage() and "a bug" in str(record.exc_info)
        assert [f.result().status_code for f in good] == [200, 200]
    assert client.post(CHAT, json=chat()).status_code == 200


def test_every_refusal_is_logged_with_the_request_s_ids_and_never_its_text(
        client: httpx.Client, serve_app, echo_llm: AsyncLLM, caplog: pytest.LogCaptureFixture) -> None:
    """Refusals used to show only as access-log lines: now one info line each says why (status, type, code,
    param, message) under the client's X-Request-Id and, once the route made one, the server's id."""
    caplog.set_level(logging.INFO, logger="pocketllm_server")
    secret = "the-secret-prompt-text"
    url = str(client.base_url)
    json_type = {"content-type": "application/json"}
    said = [{"role": "user", "content": secret}]
    refusals: dict[str, tuple[str, str, dict[str, Any]]] = {
        "temperature": ("POST", f"{url}{COMPLETIONS}", {"json": completion(prompt=secret, temperature=5)}),
        "context": ("POST", f"{url}{COMPLETIONS}", {"json": completion(prompt=secret, max_tokens=10**6)}),
        "model": ("POST", f"{url}{CHAT}", {"json": chat(model="gpt-9", messages=said)}),
        "json": ("POST", f"{url}{CHAT}", {"content": f'{{"messages": "{secret}', "headers": json_type}),
        "media": ("POST", f"{url}{COMPLETIONS}", {"content": secret, "headers": {"content-type": "text/plain"}}),
        "route": ("POST", f"{url}/v1/nope", {"json": {"prompt": secret}}),
    }
    with serve_app(create_app(echo_llm.args, served_model_name=MODEL, llm=echo_llm, api_key="k")) as keyed:
        refusals["key"] = ("POST", f"{keyed.url}{COMPLETIONS}", {"json": completion(prompt=secret)})
        for why, (method, target, kwargs) in refusals.items():
            headers = {**kwargs.pop("headers", {}), "X-Request-Id": f"why-{why}"}
            response = httpx.request(method, target, headers=headers, timeout=30, **kwargs)
            assert 400 <= response.status_code < 500, (why, response.text)
            error = response.json()["error"]
            lines = [r for r in caplog.records if r.name == "pocketllm_server" and f"'why-{why}'" in r.getMessage()]
            assert len(lines) == 1 and lines[0].levelname == "INFO", (why, [r.getMessage() for r in lines])
            line = lines[0].getMessage()
            assert f"{method} {httpx.URL(target).path}" in line and f" {response.status_code} {error['type']}" in line
            assert error["message"] in line and (error["param"] is None or f"param {error['param']}" in line), line
    context_line = next(r.getMessage() for r in caplog.records if "'why-context'" in r.getMessage())
    assert " cmpl-" in context_line  # refused after the route made its id: both ids are named
    assert not [r.getMessage() for r in caplog.records if secret in r.getMessage()]


def test_tool_errors_quote_the_request_in_json(client: httpx.Client) -> None:
    """Messages that quote a request's tool fields quote them as JSON, not as Python's reprs."""
    choice = {"type": "function", "function": {"name": "f"}}
    error = assert_error(client.post(CHAT, json=chat(tool_choice=choice)), 400, "tool_choice")
    assert '{"type": "function", "function": {"name": "f"}} needs tools' in error["message"]
    error = assert_error(client.post(CHAT, json=chat(tools=[{"type": "function"}])), 400, "tools[0]")
    assert "'" not in error["message"] and error["message"].count("{") == error["message"].count("}")


def test_tool_schemas_are_served_with_keywords_grammars_cannot_enforce(client: httpx.Client) -> None:
    """OpenAI takes these, and under tool_choice auto a schema is only shown to the model: only what is no schema at
    all is refused, not what llguidance would not enforce in a forced call."""
    schemas = [{"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                           "uniqueItems": True}}},
               {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
               {"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}}}, {"type": "object"}]},
               {"type": "object", "properties": {"u": {"type": "string", "format": "uri-reference"}}},
               {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
               {"type": "object", "properties": {"a": {"type": "string", "minLength": 3, "maxLength": 1}},
                "required": ["a"]},
               # Zod's email pattern (lookaheads), a remote reference, a bound past 64 bits, a property named type.
               {"type": "object", "properties": {"email": {"type": "string", "pattern":
                   "^(?!\\.)(?!.*\\.\\.)([A-Za-z0-9_'+\\-\\.]*)[A-Za-z0-9_+-]@([A-Za-z0-9][A-Za-z0-9\\-]*\\.)+[A-Za-z]{2,}$"}}},
               {"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}},
               {"type": "object", "properties": {"n": {"type": "integer", "maximum": 10**30}}},
               {"type": "object", "properties": {"type": {"type": "string"}, "items": {"enum": [1, "x"]}}}]
    for i, schema in enumerate(schemas):
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        response = client.post(CHAT, json=chat(tools=tools))
        assert response.status_code == 200, (i, response.text)
