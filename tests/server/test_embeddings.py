"""/v1/embeddings over HTTP and through the openai SDK: input forms, encodings, usage, refusals."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

pytest.importorskip("pocketllm_torch")


@pytest.fixture
def http(torch_server) -> httpx.Client:
    with httpx.Client(base_url=torch_server.url, timeout=60) as client:
        yield client


def embed(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/embeddings", json={"model": MODEL_NAME, **body})


def close(a: list[float], b: list[float]) -> bool:
    return max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def test_every_input_form_gives_unit_vectors_and_usage(http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": "the cat sat"}).json()["tokens"]
    one = embed(http, input="the cat sat").json()
    assert one["object"] == "list" and one["model"] == MODEL_NAME
    [item] = one["data"]
    assert item["object"] == "embedding" and item["index"] == 0
    assert abs(math.fsum(x * x for x in item["embedding"]) - 1) < 1e-4
    assert one["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids)}
    many = embed(http, input=["the cat sat", "a dog ran far away"]).json()
    assert [d["index"] for d in many["data"]] == [0, 1]
    # Beside other inputs within rounding (the batch a request shares a step with is up to timing); alone, exact.
    assert close(many["data"][0]["embedding"], item["embedding"]) and item["embedding"] != many["data"][1]["embedding"]
    assert embed(http, input=ids).json()["data"][0]["embedding"] == item["embedding"]
    both = embed(http, input=[ids, ids[:2]]).json()
    assert close(both["data"][0]["embedding"], item["embedding"]) and both["usage"]["prompt_tokens"] == len(ids) + 2
    truncated = embed(http, input=ids, truncate_prompt_tokens=2).json()
    assert truncated["data"][0]["embedding"] == embed(http, input=ids[-2:]).json()["data"][0]["embedding"]
    raw = embed(http, input="the cat sat", normalize=False).json()["data"][0]["embedding"]
    norm = math.sqrt(math.fsum(x * x for x in raw))
    assert max(abs(a / norm - b) for a, b in zip(raw, item["embedding"], strict=True)) < 1e-5


def test_base64_is_little_endian_float32(http: httpx.Client) -> None:
    floats = embed(http, input="hello").json()["data"][0]["embedding"]
    encoded = embed(http, input="hello", encoding_format="base64").json()["data"][0]["embedding"]
    data = base64.b64decode(encoded)
    decoded = struct.unpack(f"<{len(data) // 4}f", data)
    assert max(abs(a - b) for a, b in zip(decoded, floats, strict=True)) < 1e-6


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["a", 5]}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [10**12]}, "input"),
    ({"input": [-1]}, "input"),
    ({"input": "hi", "dimensions": 3}, "dimensions"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": [5] * 100_000}, "input"),
])
def test_bad_requests_are_400_naming_the_field(http: httpx.Client, body: dict, param: str) -> None:
    response = embed(http, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text
    assert embed(http, input="still serving").status_code == 200


def test_backend_without_pooling_refuses(client: httpx.Client) -> None:
    response = client.post("/v1/embeddings", json={"input": "hi"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "unsupported_option" and "echo" in error["message"] and error["param"] == "model"


def test_openai_sdk(torch_server, http: httpx.Client) -> None:
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url=f"{torch_server.url}/v1", api_key="unused", max_retries=0) as sdk:
        result = sdk.embeddings.create(model=MODEL_NAME, input=["hello", "world"])  # base64 on the wire
        floats = sdk.embeddings.create(model=MODEL_NAME, input="hello", encoding_format="float")
    assert len(result.data) == 2 and result.usage.prompt_tokens > 0
    assert max(abs(a - b) for a, b in zip(result.data[0].embedding, floats.data[0].embedding, strict=True)) < 1e-6
    assert floats.data[0].embedding == embed(http, input="hello").json()["data"][0]["embedding"]


def test_each_input_counts_against_the_queue(serve_app, torch_llm, monkeypatch) -> None:
    """With --max-queue-len 2 and 32 slots: more inputs than slots and queue together are a 400 (no retry could
    help); on a full engine, more than 2 inputs are a 503."""
    from pocketllm import BackendStats
    from pocketllm_server import create_app

    with serve_app(create_app(torch_llm.args, served_model_name=MODEL_NAME, llm=torch_llm, max_queue_len=2)) as server:
        slots = torch_llm.args.max_num_seqs
        response = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["a"] * (slots + 3)}, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_sequences"
        assert response.json()["error"]["param"] == "input"
        monkeypatch.setattr(torch_llm, "stats", lambda: BackendStats(num_running=slots))
        response = httpx.post(f"{server.url}/v1/embeddings", json={"input": ["a", "b", "c"]}, timeout=30)
        assert response.status_code == 503 and response.json()["error"]["code"] == "queue_full"
        assert httpx.post(f"{server.url}/v1/embeddings", json={"input": ["a", "b"]}, timeout=30).status_code == 200
