"""The engine loop survives callers that go away, and a loop that really dies says so to everyone."""

from __future__ import annotations

from pathlib import Path

import pytest

from pocketllm import LLM, EngineDeadError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture
def llm(pocketllm_tiny_llama: Path):
    llm = LLM(str(pocketllm_tiny_llama), backend="echo")
    yield llm
    llm.shutdown()


def test_a_caller_that_cancels_before_acceptance_does_not_kill_the_loop(llm: LLM) -> None:
    """The race behind issue 11's finding 2: a batch's caller gave up (cancelled the future) before the
    engine thread accepted the request."""
    events: list[object] = []
    with llm.driver._cond:  # hold the loop off until the future is cancelled
        request_id, accepted = llm.driver.add_request([5, 6, 7], GREEDY, events.append)
        assert accepted.cancel()
    llm.abort(request_id)
    assert llm.generate([5, 6, 7], GREEDY)[0].outputs[0].token_ids == [5, 6, 7, 5]
    assert llm.is_alive


def test_a_dead_engine_fails_every_request_and_says_so(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_step():
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.driver.engine, "step", broken_step)
    stream = llm.generate_stream([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=400))
    with pytest.raises(EngineDeadError, match="device lost"):
        list(stream)
    assert not llm.is_alive
    with pytest.raises(EngineDeadError):
        llm.generate([5, 6, 7], GREEDY)
