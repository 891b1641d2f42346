"""Issue 11's findings, each replayed against a real server on the torch backend: no input gets a 5xx or kills
the engine, bodies are bounded, connections stay usable, and the engine serves the same text afterwards."""

from __future__ import annotations

import asyncio
import gzip
import json
import re
import socket
import time
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.routing import Route

from pocketllm import AsyncLLM
from pocketllm_server import create_app
from tests.core.grammar_shapes import PAST_THE_BOUNDS
from tests.server.conftest import LiveServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
I64 = 2**63
# Integers past int64 (and far past), and the floats JSON can spell that are not finite once parsed.
HUGE_INTS = [I64, 2**64 - 1, 2**64, -(I64 + 1), 10**30]
INT_FIELDS = ["max_tokens", "n", "top_k", "seed", "min_tokens", "logprobs"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"]


def _corpus(vocab: int) -> Iterator[tuple[str, str, Any]]:
    """(name, path, JSON body) of requests that must each get a 4xx."""
    for field in INT_FIELDS:
        for value in HUGE_INTS:
            yield f"completions {field}={value}", COMPLETIONS, {"prompt": "Hello", field: value, "temperature": 1.0}
    for value in HUGE_INTS:
        yield f"chat top_k={value}", CHAT, {"messages": MESSAGES, "top_k": value, "temperature": 1.0}
        yield f"chat top_logprobs={value}", CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": value}
        yield f"logit_bias key {value}", COMPLETIONS, {"prompt": "x", "logit_bias": {str(value): 1}}
        yield f"stop_token_ids {value}", COMPLETIONS, {"prompt": "x", "stop_token_ids": [value]}
    yield "top_k beyond the vocabulary", COMPLETIONS, {"prompt": "x", "top_k": vocab + 1, "temperature": 1.0}
    for field in FLOAT_FIELDS:
        for value in ("1e400", "-1e400"):  # JSON numbers that parse to infinities
            yield f"{field}={value}", COMPLETIONS, f'{{"prompt": "x", "{field}": {value}}}'.encode()
    yield "repetition_penalty underflow", COMPLETIONS, {"prompt": "x", "repetition_penalty": 1e-300}
    yield "logit_bias value inf", COMPLETIONS, b'{"prompt": "x", "logit_bias": {"5": 1e400}}'
    for ids in ([-1], [2**32], [2**64 - 1], [vocab], [[1, 2], [vocab]], [[]], ["", "a"]):
        for echo in (False, True):
            yield f"prompt ids {ids} echo={echo}", COMPLETIONS, {"prompt": ids, "echo": echo, "max_tokens": 1}
    yield "detokenize huge id", "/detokenize", {"tokens": [2**64 - 1]}
    yield "unknown role", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}
    yield "prompt object", COMPLETIONS, {"prompt": {"text": "hi"}}
    yield "messages string", CHAT, {"messages": "hi"}
    yield "max_tokens string", COMPLETIONS, {"prompt": "x", "max_tokens": "5"}
    yield "stream string", CHAT, {"messages": MESSAGES, "stream": "yes"}
    yield "stop list of 1000", COMPLETIONS, {"prompt": "x", "stop": ["a"] * 1000}
    nested = b"[" * 2000 + b'"x"' + b"]" * 2000  # deeper than json.dumps (or msgspec) would recurse
    yield "2000 levels of nesting in prompt", COMPLETIONS, b'{"prompt": ' + nested + b"}"
    yield "2000 levels in chat_template_kwargs", CHAT, (b'{"messages": [{"role": "user", "content": "hi"}], '
                                                        b'"chat_template_kwargs": {"a": ' + nested + b"}}")
    yield "65 levels of nesting", CHAT, {"messages": MESSAGES, "tools": [_nest(65)]}
    for name, fields, _ in PAST_THE_BOUNDS:  # issue 31, item 1: these crashed the server (SIGSEGV)
        field, value = next(iter(fields.items()))
        spec = ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": value}}}
                if field == "json" else {"guided_grammar": value})
        yield f"grammar: {name}", CHAT, {"messages": MESSAGES, **spec}


def _nest(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth - 2):  # the tools list and the body itself are two levels
        value = {"a": value}
    return value


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    if status is not None:
        assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    return error


@pytest.fixture(scope="module")
def server(live_server, torch_llm: AsyncLLM) -> LiveServer:
    return live_server(create_app(torch_llm.args, served_model_name="tiny", llm=torch_llm,
                                  max_request_bytes=1024 * 1024))


@pytest.fixture
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _greedy_text(client: httpx.Client) -> str:
    response = client.post(COMPLETIONS, json={"prompt": "the cat sat on", **GREEDY})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_corpus_gets_4xx_and_the_engine_serves_the_same_text_after(client: httpx.Client,
                                                                   torch_llm: AsyncLLM) -> None:
    before = _greedy_text(client)
    failures = []
    for name, path, body in _corpus(torch_llm.vocab_size):
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = client.post(path, content=raw, headers={"content-type": "application/json"})
        try:
            assert_openai_error(response)
        except AssertionError as e:
            failures.append(f"{name}: {e}")
    assert failures == []
    assert client.get("/health").json()["status"] == "ok"
    assert _greedy_text(client) == before
    stats = torch_llm.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)


def test_tiny_top_p_and_temperature_sample_the_top_token(client: httpx.Client) -> None:
    """top_p=1e-300 underflows to 0 in float32: the top token must still be kept (it used to give empty text)."""
    greedy = _greedy_text(client)
    for extra in ({"temperature": 1.0, "top_p": 1e-300}, {"temperature": 1e-4}):
        response = client.post(COMPLETIONS, json={"prompt": "the cat sat on", **GREEDY, **extra, "seed": 1})
        assert response.json()["choices"][0]["text"] == greedy


@pytest.mark.parametrize(("raw", "content_type", "status"), [
    (b'{"prompt": "\xff\xfe bad utf-8", "max_tokens": 1}', "application/json", 400),
    (b'{"prompt": "x"}', "text/plain", 415),
    (b"prompt=x", "application/x-www-form-urlencoded", 415),
    (b'{"prompt": "x", "max_tokens": 1}', "application/json; charset=utf-8", 200),
    (b"[" * 100_000, "application/json", 400),
])
def test_raw_bodies(client: httpx.Client, raw: bytes, content_type: str, status: int) -> None:
    response = client.post(COMPLETIONS, content=raw, headers={"content-type": content_type})
    assert response.status_code == status, response.text[:200]
    if status != 200:
        assert_openai_error(response, status)


def test_bodies_over_the_limit_are_refused_before_they_are_read(server: LiveServer, client: httpx.Client) -> None:
    big = json.dumps({"prompt": "a" * (2 * 1024 * 1024)}).encode()
    started = time.monotonic()
    assert_openai_error(client.post(COMPLETIONS, content=big, headers={"content-type": "application/json"}), 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]

    response = client.post(COMPLETIONS, content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(response, 413)
    assert response.headers["connection"] == "close"
    assert time.monotonic() - started < 5


def test_a_long_prompt_is_refused_before_tokenizing_and_health_stays_responsive(
        server: LiveServer, torch_llm: AsyncLLM) -> None:
    limit = torch_llm.max_model_len * torch_llm.tokenizer.max_token_chars
    body = {"prompt": "ab " * (limit // 3 + 10), "max_tokens": 1}
    assert len(json.dumps(body)) < 1024 * 1024

    async def main() -> tuple[httpx.Response, float]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            request = asyncio.create_task(client.post(COMPLETIONS, json=body))
            await asyncio.sleep(0.01)
            started = time.monotonic()
            assert (await client.get("/health")).status_code == 200
            return await request, time.monotonic() - started

    response, health_latency = asyncio.run(main())
    assert_openai_error(response, 400)
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert health_latency < 1.0


def _raw_exchange(url: str, requests: list[bytes]) -> list[bytes]:
    """Send requests one after another on one connection; return each response's head (or b"" once closed)."""
    host, port = url.removeprefix("http://").split(":")
    heads = []
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        reader = sock.makefile("rb")
        for request in requests:
            try:
                sock.sendall(request)
            except OSError:
                heads.append(b"")
                continue
            head = b""
            while not head.endswith(b"\r\n\r\n"):
                line = reader.readline()
                if not line:
                    break
                head += line
            heads.append(head)
            lengths = [int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
            length = lengths[0] if lengths else 0
            reader.read(length)
    return heads


def test_replies_before_the_body_is_read_close_the_connection(live_server, echo_llm: AsyncLLM) -> None:
    """A 401 (or 405) sent without reading the body says Connection: close, so that the unread body is never
    taken for the next request; replies after reading it keep the connection."""
    server = live_server(create_app(echo_llm.args, served_model_name="tiny", llm=echo_llm, api_key="k"))
    body = json.dumps({"prompt": "x" * 300, "max_tokens": 1, "temperature": 0}).encode()
    post = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n%s\r\n" % (len(body), b"%s")) + body
    unauthorized = post.replace(b"%s", b"")
    authorized = post.replace(b"%s", b"Authorization: Bearer k\r\n")
    method_not_allowed = unauthorized.replace(b"POST /v1/completions", b"PUT /v1/completions")
    for first in (unauthorized, method_not_allowed):
        [head, second] = _raw_exchange(server.url, [first, authorized])
        assert head.split(b" ")[1] in (b"401", b"405") and b"connection: close" in head.lower()
        assert second == b""  # closed: nothing of the first body was read as a request
    heads = _raw_exchange(server.url, [authorized, authorized])
    assert [h.split(b" ")[1] for h in heads] == [b"200", b"200"]

    with httpx.Client(base_url=server.url, timeout=30) as client:  # keep-alive, back to back
        for i in range(40):
            headers = {"authorization": "Bearer k"} if i % 2 else {}
            response = client.post(COMPLETIONS, content=body, headers={**headers, "content-type": "application/json"})
            assert response.status_code == (200 if i % 2 else 401)


def test_openapi_describes_every_route(client: httpx.Client, server: LiveServer) -> None:
    document = client.get("/openapi.json").json()
    assert document["openapi"].startswith("3.1")
    routes = {(m.upper(), p) for p, ops in document["paths"].items() for m in ops}
    # Every route but the chat page's static files (a Mount at /ui, described as GET /ui/{path}).
    served = {(method, re.sub(r"{(\w+):\w+}", r"{\1}", route.path))  # a path parameter without its convertor
              for route in server.app.routes if isinstance(route, Route)
              for method in route.methods - {"HEAD"}} | {("GET", "/ui/{path}")}
    assert routes == served
    schemas = document["components"]["schemas"]
    assert {"ChatCompletionRequest", "CompletionRequest", "ErrorBody", "ChatCompletion"} <= set(schemas)
    post = document["paths"]["/v1/completions"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/CompletionRequest")
    assert post["responses"]["413"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")


@pytest.mark.parametrize(("method", "path", "location"), [
    ("GET", "/ui", "/ui/"),
    ("GET", "/ui?next=1", "/ui/?next=1"),
    ("GET", "/health/", "/health"),
    ("GET", "/v1/models/", "/v1/models"),
    ("POST", "/v1/completions/", "/v1/completions"),
])
def test_redirects_never_name_the_host_the_client_sent(client: httpx.Client, method: str, path: str,
                                                       location: str) -> None:
    """Starlette's trailing-slash redirects used to be absolute URLs built from the Host header: any host."""
    response = client.request(method, path, headers={"host": "evil.example"}, json={"prompt": "x", "max_tokens": 1})
    assert response.status_code == 307 and response.headers["location"] == location
    followed = client.request(method, path, json={"prompt": "x", "max_tokens": 1}, follow_redirects=True)
    assert followed.url.host == "127.0.0.1" and followed.url.path == location.split("?")[0]


def test_gzip_and_deflate_bodies_are_decoded_within_the_limit(client: httpx.Client) -> None:
    body = json.dumps({"prompt": "the cat sat on", **GREEDY}).encode()
    plain = client.post(COMPLETIONS, content=body, headers={"content-type": "application/json"}).json()
    for coding, encoded in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        response = client.post(COMPLETIONS, content=encoded,
                               headers={"content-type": "application/json", "content-encoding": coding})
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == plain["choices"][0]["text"]
    # A bomb: a few KB that would inflate to 16 MiB, past the 1 MiB limit. Refused once a byte past it was decoded.
    bomb = gzip.compress(b'{"prompt": "' + b" " * (16 << 20))
    assert len(bomb) < 128 << 10
    started = time.monotonic()
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    error = assert_openai_error(client.post(COMPLETIONS, content=bomb, headers=headers), 413)
    assert "decoded" in error["message"] and time.monotonic() - started < 5
    # Decoded, one byte past the limit (JSON's trailing spaces pad it): 413; at the limit it would be served.
    padded = body + b" " * (1024 * 1024 + 1 - len(body))
    assert_openai_error(client.post(COMPLETIONS, content=gzip.compress(padded), headers=headers), 413)
    at_limit = client.post(COMPLETIONS, content=gzip.compress(padded[:-1]), headers=headers)
    assert at_limit.status_code == 200, at_limit.text
    # gzip members one after another are one body, as gzip writes them; data after a deflate stream is not.
    split = client.post(COMPLETIONS, content=gzip.compress(body[:10]) + gzip.compress(body[10:]), headers=headers)
    assert split.json()["choices"][0]["text"] == plain["choices"][0]["text"]
    assert_openai_error(client.post(COMPLETIONS, content=zlib.compress(body) + b"{}", headers={
        "content-type": "application/json", "content-encoding": "deflate"}), 400)
    assert_openai_error(client.post(COMPLETIONS, content=b"not gzip", headers=headers), 400)
    assert_openai_error(client.post(COMPLETIONS, content=gzip.compress(body)[:-12], headers=headers), 400)
    assert_openai_error(client.post(COMPLETIONS, content=body, headers={"content-type": "application/json",
                                                                        "content-encoding": "br"}), 415)
    assert client.get("/health").json()["status"] == "ok"
