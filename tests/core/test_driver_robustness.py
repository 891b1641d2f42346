"""The engine loop survives callers that go away, and a loop that really dies says so to everyone."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pocketllm import LLM, EngineDeadError, SamplingParams
from pocketllm.plugins import BackendRegistry
from pocketllm.testing import GatedBackend, StepGate, engine_driver

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture
def gated(pocketllm_tiny_llama: Path) -> Iterator[tuple[LLM, StepGate]]:
    registry = BackendRegistry()
    backend = GatedBackend.install(registry, "echo")
    llm = LLM(str(pocketllm_tiny_llama), backend=backend.name, registry=registry)
    yield llm, backend.gate
    llm.shutdown()


def test_a_caller_that_cancels_before_acceptance_does_not_kill_the_loop(gated: tuple[LLM, StepGate]) -> None:
    """The race behind issue 11's finding 2: a batch's caller gave up (cancelled the future) before the
    engine thread accepted the request."""
    llm, _ = gated
    driver = engine_driver(llm)
    held, release = threading.Event(), threading.Event()

    def holding_sink(event: object) -> None:  # holds the engine thread (in its events) until the future is cancelled
        held.set()
        release.wait(10)

    driver.add_request([1, 2], GREEDY, holding_sink)
    assert held.wait(10)
    events: list[object] = []
    try:
        request_id, accepted = driver.add_request([5, 6, 7], GREEDY, events.append)
        assert accepted.cancel()
    finally:
        release.set()
    llm.abort(request_id)
    assert llm.generate([5, 6, 7], GREEDY)[0].outputs[0].token_ids == [5, 6, 7, 5]
    assert llm.is_alive


def test_a_dead_engine_fails_every_request_and_says_so(gated: tuple[LLM, StepGate]) -> None:
    llm, gate = gated
    gate.fail_next_step(RuntimeError("device lost"))
    stream = llm.generate_stream([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=400))
    with pytest.raises(EngineDeadError, match="device lost"):
        list(stream)
    assert not llm.is_alive
    with pytest.raises(EngineDeadError):
        llm.generate([5, 6, 7], GREEDY)


def test_streams_made_during_a_step_do_not_wait_for_it_and_join_one_step(gated: tuple[LLM, StepGate]) -> None:
    """generate_stream queues its request and returns: made one after another while a step runs, the streams
    neither wait that step out each in turn nor take a step each."""
    llm, gate = gated
    driver = engine_driver(llm)
    held, release = threading.Event(), threading.Event()

    def holding_sink(event: object) -> None:  # holds the engine thread inside a step's events
        held.set()
        release.wait(10)

    driver.add_request([1, 2], SamplingParams(temperature=0.0, max_tokens=1), holding_sink)
    assert held.wait(10)
    try:
        streams = [llm.generate_stream([5, 6, 7 + i], GREEDY) for i in range(3)]  # before: blocked until release
        steps_before = gate.steps
    finally:
        release.set()
    assert [[t for e in s for t in e.token_ids] for s in streams] == [[5, 6, 7 + i, 5] for i in range(3)]
    assert gate.batch_sizes[steps_before] == 3, gate.batch_sizes


def test_a_stream_the_engine_refuses_raises_at_its_first_event(gated: tuple[LLM, StepGate],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    llm, _ = gated
    engine = engine_driver(llm).engine
    add = engine.add_request

    def refuse_one(request_id: str, prompt_token_ids: list[int], *args: object, **kwargs: object) -> None:
        if prompt_token_ids == [9, 9]:
            raise ValueError("no room for this one")
        add(request_id, prompt_token_ids, *args, **kwargs)

    monkeypatch.setattr(engine, "add_request", refuse_one)
    refused = llm.generate_stream([9, 9], GREEDY)
    kept = llm.generate_stream([5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match="no room"):
        next(refused)
    assert list(refused) == []
    assert [t for e in kept for t in e.token_ids] == [5, 6, 7, 5]
    assert llm.is_alive
    # A refused stream closed unread does not cancel a later request that took its id.
    unread = llm.generate_stream([9, 9], GREEDY, request_id="reused")
    llm.generate([5, 6], GREEDY)  # the loop has taken (and refused) `unread` before this one
    reuser = llm.generate_stream([5, 6, 7], GREEDY, request_id="reused")
    unread.close()
    assert [t for e in reuser for t in e.token_ids] == [5, 6, 7, 5]
