"""Grammars over HTTP that crashed the server or came back as 500s (issue 31, items 1 and 6): each is a 400 naming
its field and the limit, and the server keeps serving. The tiny model on the torch backend."""

from __future__ import annotations

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


def test_a_forced_tool_call_whose_parameters_chain_is_a_400(tools_client: httpx.Client) -> None:
    """The forcing grammar embeds the parameters schema with %json: its chain is measured there too."""
    client = tools_client
    parameters = {"type": "object", "properties": {"a": {"$ref": "#/$defs/d0"}}, "required": ["a"],
                  "$defs": ref_chain(5000, "ref")["$defs"]}
    tools = [{"type": "function", "function": {"name": "deep", "parameters": parameters}}]
    for choice in ("required", {"type": "function", "function": {"name": "deep"}}):
        assert_refused(chat(client, tools=tools, tool_choice=choice), "tool_choice", "more than 512 deep")
    assert chat(client).status_code == 200
