"""--api-key protects the API; the operational endpoints stay open."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from pocketllm import AsyncLLM, EngineArgs
from pocketllm_server import create_app

KEY = "sk-test-123"
PROTECTED = [("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": 0,
                                                "max_tokens": 2}),
             ("POST", "/v1/completions", {"prompt": "hi", "temperature": 0, "max_tokens": 2}),
             ("GET", "/v1/models", None),
             ("POST", "/tokenize", {"prompt": "hi"}),
             ("POST", "/detokenize", {"tokens": [5]})]


@pytest.fixture(scope="module")
def url(live_server, tiny_args: EngineArgs, echo_llm: AsyncLLM) -> str:
    return live_server(create_app(tiny_args, served_model_name="tiny", api_key=KEY, llm=echo_llm)).url


@pytest.fixture
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=30) as client:
        yield client


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", "Bearer", KEY])
def test_missing_or_wrong_key_is_401(client: httpx.Client, method: str, path: str, body: object,
                                     authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    response = client.request(method, path, json=body, headers=headers)
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error" and error["message"]
    assert response.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
def test_right_key_is_accepted(client: httpx.Client, method: str, path: str, body: object) -> None:
    response = client.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path", ["/health", "/alive", "/ready", "/metrics"])
def test_operational_endpoints_need_no_key(client: httpx.Client, path: str) -> None:
    assert client.get(path).status_code == 200


def test_openai_sdk_sends_the_key(url: str) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) as sdk:
        assert sdk.models.list().data[0].id == "tiny"
    with openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0) as sdk, \
            pytest.raises(openai.AuthenticationError):
        sdk.models.list()
