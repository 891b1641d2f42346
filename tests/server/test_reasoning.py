"""--reasoning-parser: a reply's <think> section split from its answer, whole and streamed, over scripted replies
(tags split across pieces, a section never closed) and over HTTP with the echo backend."""

from __future__ import annotations

import json

import httpx
import pytest

from pocketllm import AsyncLLM
from pocketllm.reasoning import ReasoningSplitter
from pocketllm_server import create_app

REPLY = "<think>\nweigh it: a < b, and </thin is not a tag</think>\n\nThe answer is 4."


def stream(parser: str, pieces: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(parser)
    reasoning = answer = ""
    for piece in pieces:
        r, a = splitter.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = splitter.finish()
    return reasoning + r, answer + a


@pytest.mark.parametrize("size", [1, 2, 3, 7, len(REPLY)])
def test_streamed_pieces_reassemble_to_the_whole_split(size: int) -> None:
    pieces = [REPLY[i:i + size] for i in range(0, len(REPLY), size)]
    assert stream("qwen3", pieces) == ("\nweigh it: a < b, and </thin is not a tag", "The answer is 4.")


@pytest.mark.parametrize(("parser", "reply", "expected"), [
    ("qwen3", "No thinking here.", ("", "No thinking here.")),  # thinking off: all answer
    ("qwen3", "<think>still thinking when tokens ran o", ("still thinking when tokens ran o", "")),
    ("qwen3", "<thi", ("", "<thi")),  # the start of a tag that never came: plain text
    ("deepseek_r1", "reasoned</think>answer", ("reasoned", "answer")),  # the template opened the section
    ("deepseek_r1", "<think>x</think>y", ("x", "y")),
    ("deepseek_r1", "never closed", ("never closed", "")),
])
def test_sections_whole_and_character_by_character(parser: str, reply: str, expected: tuple[str, str]) -> None:
    assert stream(parser, [reply]) == expected == stream(parser, list(reply))


def test_chat_over_http_splits_reasoning_and_counts_it(serve_app, tiny_args, echo_llm: AsyncLLM) -> None:
    """The echo backend replays the rendered prompt, so a user turn holding </think> scripts the reply."""
    app = create_app(tiny_args, served_model_name="tiny", llm=echo_llm, reasoning_parser="deepseek_r1")
    body = {"messages": [{"role": "user", "content": "plan</think>done"}], "max_tokens": 40, "temperature": 0}
    with serve_app(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        whole = client.post("/v1/chat/completions", json=body).json()
        message = whole["choices"][0]["message"]
        assert message["reasoning_content"] == message["reasoning"] and message["reasoning_content"].endswith("plan")
        assert message["content"].startswith("done")
        assert 0 < whole["usage"]["completion_tokens_details"]["reasoning_tokens"] < whole["usage"]["completion_tokens"]
        streamed = {"reasoning_content": "", "content": ""}
        with client.stream("POST", "/v1/chat/completions", json=body | {
                "stream": True, "stream_options": {"include_usage": True}}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    for choice in chunk["choices"]:
                        for key in streamed:
                            streamed[key] += choice["delta"].get(key) or ""
                    if chunk.get("usage"):
                        usage = chunk["usage"]
    assert streamed == {"reasoning_content": message["reasoning_content"], "content": message["content"]}
    assert usage["completion_tokens_details"] == whole["usage"]["completion_tokens_details"]


def test_stop_strings_inside_the_reasoning_section_do_not_end_the_reply(serve_app, tiny_args,
                                                                         echo_llm: AsyncLLM) -> None:
    app = create_app(tiny_args, served_model_name="tiny", llm=echo_llm, reasoning_parser="deepseek_r1")
    body = {"messages": [{"role": "user", "content": "plan STOP more</think>done STOP after"}], "max_tokens": 60,
            "temperature": 0, "stop": ["STOP"]}
    with serve_app(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        message = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert message["finish_reason"] == "stop"
        assert message["message"]["reasoning_content"].endswith("plan STOP more")
        assert message["message"]["content"] == "done "
        asked = client.post("/v1/chat/completions", json=body | {"stop_in_reasoning": True}).json()["choices"][0]
        assert asked["message"]["reasoning_content"].endswith("plan ") and not asked["message"]["content"]


def test_stop_in_reasoning_without_a_reasoning_parser_is_refused(client: httpx.Client) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "stop_in_reasoning": True}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "stop_in_reasoning"
