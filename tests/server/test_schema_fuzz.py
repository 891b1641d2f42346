"""Schemathesis against /openapi.json on a real server (torch backend, tiny model): no input gets a 5xx, and
every 4xx has an OpenAI error body. Bounded to a few dozen cases per route so that it fits CI."""

from __future__ import annotations

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("pocketllm_torch")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from pocketllm import AsyncLLM, EngineArgs, __version__  # noqa: E402
from pocketllm_server import create_app  # noqa: E402
from pocketllm_server.openapi import openapi_document  # noqa: E402
from tests.server.conftest import LiveServer  # noqa: E402

# The document the server serves (test_hardening checks that it lists every route).
schema = schemathesis.openapi.from_dict(openapi_document(title="PocketLLM", version=__version__, api_key=False))
# Valid requests and invalid ones (wrong types, out-of-range values, missing fields), derived from the schema.
schema.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
MAX_EXAMPLES = 60


@pytest.fixture(scope="module")
def fuzz_server(live_server, pocketllm_tiny_llama) -> LiveServer:
    # A short context keeps each generated request cheap: the fuzzer likes max_tokens in the billions.
    llm = AsyncLLM(EngineArgs(model=str(pocketllm_tiny_llama), backend="torch", max_model_len=48, dtype="float32"))
    server = live_server(create_app(llm.args, served_model_name="tiny", llm=llm, max_request_bytes=256 * 1024))
    yield server
    llm.shutdown()


def openai_error_body(ctx, response, case) -> None:
    """A 4xx carries ``{"error": {"message": str, "type": str, ...}}``."""
    if 400 <= response.status_code < 500:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), response.text


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_5xx_and_openai_errors(case, fuzz_server: LiveServer) -> None:
    case.call_and_validate(base_url=fuzz_server.url, checks=[not_a_server_error, openai_error_body], timeout=60)


def test_engine_is_idle_and_serving_after_the_fuzzing(fuzz_server: LiveServer) -> None:
    health = httpx.get(f"{fuzz_server.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["num_requests_running"] == 0
