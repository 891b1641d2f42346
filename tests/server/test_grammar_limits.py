"""Grammars over HTTP that crashed the server or came back as 500s (issue 31, items 1 and 6): each is a 400 naming
its field and the limit, and the server keeps serving. The tiny model on the torch backend."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pocketllm import AsyncLLM, EngineArgs
from pocketllm_server import create_app
from tests.core.grammar_shapes import PAST_THE_BOUNDS, ref_chain
from tests.server.conftest import LiveServer

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(torch_server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=torch_server.url, timeout=120) as c:
        yield c


def chat(client: httpx.Client, **fields: Any) -> httpx.Response:
    return client.post(CHAT, json={"messages": MESSAGES, "max_tokens": 4, "temperature": 0} | fields)


def as_request(fields: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """StructuredOutputs fields as the request field a client sends, and that field's name."""
    if "json" in fields:
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": fields["json"]}}
        return {"response_format": fmt}, "response_format"
    [(key, value)] = fields.items()
    name = {"grammar": "guided_grammar", "regex": "guided_regex", "choice": "guided_choice"}[key]
    return {name: value}, name


def assert_refused(reply: httpx.Response, param: str, words: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert len(error["message"]) < 400, error["message"]


@pytest.mark.parametrize(("name", "fields", "limit"), PAST_THE_BOUNDS, ids=[p[0] for p in PAST_THE_BOUNDS])
def test_chains_that_crashed_the_server_are_400s_naming_the_limit(client: httpx.Client, name: str,
                                                                   fields: dict[str, Any], limit: str) -> None:
    body, param = as_request(fields)
    assert_refused(chat(client, **body), param, limit)
    assert chat(client).status_code == 200


@pytest.fixture(scope="module")
def tools_client(pocketllm_tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory,
                 live_server: Callable[..., LiveServer]) -> Iterator[httpx.Client]:
    """A server whose chat template shows only the tools' names: their schemas stay out of the short prompt."""
    path = tmp_path_factory.mktemp("tools") / "tiny"
    shutil.copytree(pocketllm_tiny_llama, path)
    (path / "chat_template.jinja").write_text(
        "{% for tool in tools or [] %}{{ tool.function.name }} {% endfor %}{% for m in messages %}<|im_start|>"
        "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n", encoding="utf-8")
    llm = AsyncLLM(EngineArgs(model=str(path), backend="torch", device="cpu"))
    server = live_server(create_app(llm.args, served_model_name="tiny", llm=llm, tool_call_parser="hermes"))
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c
    llm.shutdown()


def test_a_tool_whose_parameters_chain_is_a_400(tools_client: httpx.Client) -> None:
    """The forcing grammar would embed the parameters schema with %json: its chain is measured, under every
    tool_choice (tools are checked whether or not a call is forced), and the 400 names the parameters."""
    client = tools_client
    parameters = {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "required": ["a"],
                  "$defs": ref_chain(5000, "ref")["$defs"]}
    tools = [{"type": "function", "function": {"name": "deep", "parameters": parameters}}]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "deep"}}):
        assert_refused(chat(client, tools=tools, tool_choice=choice), "tools[0].function.parameters",
                       "more than 512 deep")
    assert chat(client).status_code == 200


# Issue 31, item 6: client mistakes that came back as 500s with llguidance's parser state in the message.
MISTAKES = [
    ("regex that never matches", {"guided_regex": "[^\\s\\S]"}, "matches no text"),
    ("Lark grammar with an empty language", {"guided_grammar": 'start: a\na: a "x"'}, "matches no text"),
    ("GBNF a{1000000}", {"guided_grammar": 'root ::= "a"{1000000}'}, "repetition count of 1000000"),
    ("2,001 alternatives", {"guided_grammar": "start: " + " | ".join(f'"a{i}"' for i in range(2001))},
     "more than 2000 alternatives"),
    ("2,001 choices", {"guided_choice": [f"a{i}" for i in range(2001)]}, "more than 2000"),
    ("$ref to the root", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"$ref": "#"}}}}, "$ref cycle"),
    ("$ref a->b->a", {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}}, "$ref cycle"),
    ("choice of a special token", {"guided_choice": ["<|im_end|>"]}, "special token"),
    ("grammar text of a special token", {"guided_grammar": 'start: "x<|im_end|>"'}, "special token"),
    ("regex with a lookaround", {"guided_regex": "a(?=b)"}, "invalid regex"),
]


@pytest.mark.parametrize(("name", "fields", "words"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_grammar_mistakes_are_short_400s(client: httpx.Client, name: str, fields: dict[str, Any],
                                         words: str) -> None:
    assert_refused(chat(client, **fields), next(iter(fields)), words)


def test_as_many_choices_as_the_limit_allows_work(client: httpx.Client) -> None:
    """2,000 options: llguidance's row holds them and the item around them (its own limit was one short)."""
    options = [f"b{i}x" for i in range(2000)]
    reply = chat(client, guided_choice=options, max_tokens=12)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] in options


def test_a_forced_tool_named_as_a_special_token_is_a_400(tools_client: httpx.Client) -> None:
    tools = [{"type": "function", "function": {"name": "<|im_end|>", "parameters": {"type": "object"}}}]
    choice = {"type": "function", "function": {"name": "<|im_end|>"}}
    assert_refused(chat(tools_client, tools=tools, tool_choice=choice), "tool_choice", "special token")


def test_min_tokens_beyond_the_grammar_is_a_400_naming_min_tokens(client: httpx.Client) -> None:
    """The grammar completes after a few tokens, and min_tokens bans the end of the reply: nothing may follow."""
    fields = {"guided_choice": ["yes"], "min_tokens": 12, "max_tokens": 20}
    assert_refused(chat(client, **fields), "min_tokens", "min_tokens=12")
    with client.stream("POST", CHAT, json={"messages": MESSAGES, "stream": True, **fields}) as reply:
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: {")]
    error = json.loads(events[-1])["error"]
    assert error["param"] == "min_tokens" and error["type"] == "invalid_request_error", error
    assert chat(client, guided_choice=["yes"], max_tokens=20).json()["choices"][0]["message"]["content"] == "yes"
