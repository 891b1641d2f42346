"""Schemathesis against /openapi.json on a real server (torch backend, tiny model): no input gets a 5xx, and
every 4xx has the error body of its API (OpenAI's, Anthropic's, Ollama's). Bounded to a few dozen cases per route
so that it fits CI. Grammar fields get grammar-shaped text (regex, Lark and GBNF pieces, chains of rules) and JSON
schemas of every shape (references, cycles, chains), not only what the document's types allow."""

from __future__ import annotations

import json

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("pocketllm_torch")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from pocketllm import AsyncLLM, EngineArgs, __version__  # noqa: E402
from pocketllm_server import create_app  # noqa: E402
from pocketllm_server.openapi import openapi_document  # noqa: E402
from tests.core.grammar_shapes import gbnf_chain, lark_chain, ref_chain  # noqa: E402
from tests.server.conftest import LiveServer  # noqa: E402


def _pieces(*parts: str) -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(parts), max_size=24).map("".join)


REGEXES = _pieces("a", "[a-z]", "[^\\s\\S]", "(", ")", "|", "*", "+?", "{3}", "{2,5}", "{1000000}", "(?=x)",
                  "\\b", "\\d", ".", "^", "$", "\\", "[", "]", "{", "<|im_end|>")
CHAINS = st.builds(lambda make, n: make(n), st.sampled_from([lark_chain, gbnf_chain]),
                   st.sampled_from([1, 40, 900, 1100, 6000]))
GRAMMARS = st.one_of(
    _pieces("start: ", "r: ", "R: ", "\n", '"a"', "/[0-9]+/", " | ", "(", ")", "[", "]", "{4}", "{100000}", " ~ 3",
            "%json {}", '%json {"$ref": "#"}', " r", " start", '"<|im_end|>"', "// c\n", "?", "*", "%ignore "),
    _pieces("root ::= ", "r ::= ", "\n", '"a"', "[a-z]", " | ", "(", ")", "{1000000}", "*", " r", " root", "# c\n"),
    CHAINS)
CHOICES = st.sampled_from(["yes", "a" * 3000, "<|im_end|>", "\u0000", "{", "</s>"])
LEAVES = st.sampled_from([{"type": "integer"}, {"$ref": "#"}, {"$ref": "#/$defs/a"}, {"$ref": "#/$defs/missing"},
                          {}, True, False, {"type": "string", "pattern": "a{100000}"}, {"enum": []},
                          {"type": "string", "minLength": 5, "maxLength": 2}])
SCHEMAS = st.one_of(
    st.recursive(LEAVES, lambda inner: st.one_of(
        st.builds(lambda p: {"type": "object", "properties": p, "required": list(p)[:1]},
                  st.dictionaries(st.sampled_from("abc"), inner, max_size=3)),
        st.builds(lambda i: {"type": "array", "items": i}, inner),
        st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)),
        st.builds(lambda xs: {"allOf": xs}, st.lists(inner, max_size=2)),
        st.builds(lambda d, r: {"$defs": d, **r} if isinstance(r, dict) else r,
                  st.dictionaries(st.sampled_from("ab"), inner, max_size=2), inner)), max_leaves=12),
    st.builds(ref_chain, st.sampled_from([3, 100, 600, 5000]),
              st.sampled_from(["properties", "items", "prefixItems", "anyOf", "allOf", "ref"])))
for _format, _strategy in (("pocketllm-regex", REGEXES), ("pocketllm-grammar", GRAMMARS),
                           ("pocketllm-choice", CHOICES)):
    schemathesis.openapi.format(_format, _strategy)


def _grammar_formats(document: dict) -> dict:
    """The document with the grammar fields' strings in the formats above, so the fuzz sends grammar text."""
    for request in ("ChatCompletionRequest", "CompletionRequest"):
        properties = document["components"]["schemas"][request]["properties"]
        properties["guided_regex"]["anyOf"][0]["format"] = "pocketllm-regex"
        properties["guided_grammar"]["anyOf"][0]["format"] = "pocketllm-grammar"
        properties["guided_choice"]["anyOf"][0]["items"]["format"] = "pocketllm-choice"
    return document


# The document the server serves (test_hardening checks that it lists every route).
schema = schemathesis.openapi.from_dict(
    _grammar_formats(openapi_document(title="PocketLLM", version=__version__, api_key=False)))
# Valid requests and invalid ones (wrong types, out-of-range values, missing fields), derived from the schema.
schema.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
MAX_EXAMPLES = 60
GRAMMAR_EXAMPLES = 40  # each compiles a grammar: ~0.35 s apiece here


@pytest.fixture(scope="module")
def fuzz_server(live_server, pocketllm_tiny_llama) -> LiveServer:
    # A short context keeps each generated request cheap: the fuzzer likes max_tokens in the billions.
    llm = AsyncLLM(EngineArgs(model=str(pocketllm_tiny_llama), backend="torch", max_model_len=48, dtype="float32"))
    server = live_server(create_app(llm.args, served_model_name="tiny", llm=llm, max_request_bytes=256 * 1024))
    yield server
    llm.shutdown()


def api_error_body(ctx, response, case) -> None:
    """A 4xx carries the error body of the API asked: OpenAI's ``{"error": {"message": str, "type": str, ...}}``,
    Anthropic's ``{"type": "error", "error": {"type": str, "message": str}}`` on /v1/messages, Ollama's
    ``{"error": str}`` on /api."""
    if not 400 <= response.status_code < 500:
        return
    body = response.json()
    if case.path.startswith("/api/"):
        assert isinstance(body["error"], str), response.text
        return
    if case.path.startswith("/v1/messages"):
        assert body["type"] == "error", response.text
    assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), response.text


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_5xx_and_api_errors(case, fuzz_server: LiveServer) -> None:
    case.call_and_validate(base_url=fuzz_server.url, checks=[not_a_server_error, api_error_body], timeout=60)


@given(spec=st.one_of(SCHEMAS.map(lambda s: ("response_format", {"type": "json_schema",
                                                                   "json_schema": {"name": "s", "schema": s}})),
                      SCHEMAS.map(lambda s: ("structured_outputs", {"json": s})),
                      REGEXES.map(lambda r: ("guided_regex", r)), GRAMMARS.map(lambda g: ("guided_grammar", g)),
                      st.lists(CHOICES, min_size=1, max_size=3).map(lambda c: ("guided_choice", c))),
       stream=st.booleans(), min_tokens=st.sampled_from([0, 0, 30]))
@settings(max_examples=GRAMMAR_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_grammars_of_every_shape_get_no_5xx(spec: tuple[str, object], stream: bool, min_tokens: int,
                                             fuzz_server: LiveServer) -> None:
    field, value = spec
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "min_tokens": min_tokens,
            "stream": stream, field: value}
    with httpx.stream("POST", f"{fuzz_server.url}/v1/chat/completions", json=body, timeout=60) as reply:
        text = reply.read().decode()
    assert reply.status_code < 500, text
    if reply.status_code >= 400:
        assert isinstance(json.loads(text)["error"]["message"], str), text
    for line in text.splitlines():  # a stream's error event is a client error too
        if line.startswith('data: {"error"'):
            assert json.loads(line[6:])["error"]["type"] == "invalid_request_error", line


def test_engine_is_idle_and_serving_after_the_fuzzing(fuzz_server: LiveServer) -> None:
    health = httpx.get(f"{fuzz_server.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["num_requests_running"] == 0
