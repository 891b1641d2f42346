"""vLLM's /tokenize and /detokenize."""

from __future__ import annotations

import httpx

from pocketllm import AsyncLLM

MESSAGES = [{"role": "user", "content": "hello"}]


def test_tokenize_a_prompt(client: httpx.Client, echo_llm: AsyncLLM) -> None:
    response = client.post("/tokenize", json={"model": "tiny", "prompt": "hello world"})
    assert response.status_code == 200
    ids = echo_llm.tokenizer.encode("hello world")
    assert response.json() == {"count": len(ids), "max_model_len": echo_llm.args.max_model_len, "tokens": ids}
    without = client.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False}).json()
    assert without["tokens"] == echo_llm.tokenizer.encode("hello world", add_special_tokens=False)


def test_tokenize_messages(client: httpx.Client, echo_llm: AsyncLLM) -> None:
    _, ids = echo_llm.render_chat(MESSAGES)
    assert client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"] == ids
    _, no_prompt = echo_llm.render_chat(MESSAGES, add_generation_prompt=False)
    response = client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    assert response.json()["tokens"] == no_prompt and len(no_prompt) < len(ids)


def test_tokenize_errors(client: httpx.Client) -> None:
    for body, param in (({}, "prompt"), ({"prompt": "a", "messages": MESSAGES}, "prompt"),
                        ({"prompt": 5}, "prompt"), ({"messages": []}, "messages"),
                        ({"messages": [{"role": "alien", "content": "x"}]}, "messages")):
        response = client.post("/tokenize", json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, body


def test_detokenize_round_trip(client: httpx.Client) -> None:
    tokens = client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    prompt = client.post("/detokenize", json={"model": "tiny", "tokens": tokens}).json()["prompt"]
    assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_detokenize_errors(client: httpx.Client) -> None:
    for tokens in ([-1], [10**6], "abc"):
        response = client.post("/detokenize", json={"tokens": tokens})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"
    assert client.post("/detokenize", json={"tokens": [1], "model": "other"}).status_code == 404
