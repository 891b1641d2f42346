"""Sampling fields a request leaves out take the model's recommended settings, as vLLM's --generation-config auto."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from pocketllm import AsyncLLM, EngineArgs
from pocketllm_server import create_app


@pytest.fixture(scope="module")
def recommending_llm(pocketllm_tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    model = tmp_path_factory.mktemp("gen") / "model"
    shutil.copytree(pocketllm_tiny_llama, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 3}))
    llm = AsyncLLM(EngineArgs(model=str(model), backend="echo"))
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_defaults_from_the_model_and_the_switch_that_turns_them_off(serve_app, recommending_llm: AsyncLLM,
                                                                    path: str) -> None:
    body = {"prompt": "hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    with serve_app(create_app(recommending_llm.args, served_model_name="tiny", llm=recommending_llm)) as server:
        response = httpx.post(server.url + path, json=body)
        assert response.status_code == 200, response.text  # echo is greedy only: temperature 0 came from the model
        assert response.json()["usage"]["completion_tokens"] == 3
        explicit = httpx.post(server.url + path, json={**body, "max_tokens": 5})
        assert explicit.json()["usage"]["completion_tokens"] == 5  # the request's own value wins
    with serve_app(create_app(recommending_llm.args, served_model_name="tiny", llm=recommending_llm,
                              generation_config="none")) as server:
        response = httpx.post(server.url + path, json=body)
        assert response.status_code == 400 and response.json()["error"]["param"] == "temperature"
