"""The library API (LLM, AsyncLLM) on the echo backend, whose output is predictable."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from pocketllm import LLM, AsyncLLM, ConfigError, SamplingParams, StreamEvent
from pocketllm.testing import engine_driver

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(pocketllm_tiny_llama: Path):
    llm = LLM(str(pocketllm_tiny_llama), backend="echo")
    yield llm
    llm.shutdown()


def test_generate_accepts_every_prompt_shape(llm: LLM) -> None:
    ids = llm.tokenizer.encode("one two")
    assert len(llm.generate("one two", GREEDY)) == 1
    assert len(llm.generate(["a", "b", "c"], GREEDY)) == 3
    [by_ids] = llm.generate(ids, GREEDY)
    assert by_ids.prompt is None and by_ids.prompt_token_ids == ids
    assert len(llm.generate([ids, ids], GREEDY)) == 2
    with pytest.raises(ConfigError, match="prompts"):
        llm.generate([], GREEDY)


def test_n_choices_share_the_prompt_and_count_usage(llm: LLM) -> None:
    [out] = llm.generate("hello", SamplingParams(temperature=0.0, max_tokens=3, n=3))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.usage.prompt_tokens == len(llm.tokenizer.encode("hello"))
    assert out.usage.completion_tokens == 9


def test_request_ids_are_honoured_and_unique(llm: LLM) -> None:
    [out] = llm.generate("x", GREEDY, request_ids=["my-id"])
    assert out.request_id == "my-id"
    release = threading.Event()
    events: list[object] = []

    def blocking_sink(event: object) -> None:  # holds the engine thread so "busy" cannot finish yet
        events.append(event)
        release.wait(10)

    _, accepted = engine_driver(llm).add_request(llm.tokenizer.encode("x"), GREEDY, blocking_sink, "busy")
    try:
        with pytest.raises(ConfigError, match="request_id"):
            llm.generate("x", GREEDY, request_ids=["busy"])
    finally:
        release.set()
    accepted.result()


def test_a_late_abort_spares_a_new_request_reusing_the_id(llm: LLM) -> None:
    release, finished = threading.Event(), threading.Event()

    def blocking_sink(event: StreamEvent) -> None:  # holds the engine thread inside the first request's last event
        if event.finish_reason is not None:
            finished.set()
            release.wait(10)

    _, accepted = engine_driver(llm).add_request(llm.tokenizer.encode("x"), GREEDY, blocking_sink, "reused")
    accepted.result()
    assert finished.wait(10)
    try:
        # The client cancels the request it saw running and reuses its id at once: both commands reach the
        # engine thread together, and the abort must not hit the new request.
        llm.abort("reused")
        second: list[StreamEvent] = []
        second_done = threading.Event()

        def sink(event: StreamEvent) -> None:
            second.append(event)
            if event.finish_reason is not None:
                second_done.set()

        _, accepted = engine_driver(llm).add_request(llm.tokenizer.encode("x"), GREEDY, sink, "reused")
    finally:
        release.set()
    accepted.result()
    assert second_done.wait(10)
    assert second[-1].finish_reason == "length"
    assert sum(len(e.token_ids) for e in second) == GREEDY.max_tokens


def test_chat_renders_the_template(llm: LLM) -> None:
    text, ids = llm.render_chat([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    [out] = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0.0, max_tokens=len(ids)))
    # echo repeats the prompt; special tokens are skipped when detokenizing
    assert out.outputs[0].text == "user\nhi\nassistant\n"
    outs = llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]], GREEDY)
    assert len(outs) == 2
    events = list(llm.chat_stream([{"role": "user", "content": "hi"}], GREEDY))
    assert events[-1].usage is not None


def test_stop_token_ids_and_eos(llm: LLM) -> None:
    ids = llm.tokenizer.encode("abc")
    [out] = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[ids[1]]))
    choice = out.outputs[0]
    assert choice.token_ids == ids[:2] and (choice.finish_reason, choice.stop_reason) == ("stop", ids[1])
    [out] = llm.generate([5, 0, 7], SamplingParams(temperature=0.0, max_tokens=10))  # id 0 is EOS
    assert out.outputs[0].token_ids == [5, 0] and out.outputs[0].stop_reason is None
    [out] = llm.generate([5, 0, 7], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3))
    assert out.outputs[0].token_ids[:3] == [5, 7, 7]  # EOS is masked until min_tokens, then ends the request
    assert out.outputs[0].token_ids[3:] == [5, 0] and out.outputs[0].finish_reason == "stop"


def test_bad_token_ids_are_config_errors(llm: LLM) -> None:
    with pytest.raises(ConfigError, match="logit_bias"):
        llm.generate("x", SamplingParams(temperature=0.0, logit_bias={10**6: 1.0}))
    with pytest.raises(ConfigError, match="prompt"):
        llm.generate([[1, 2, 10**6]], GREEDY)


def test_backend_rejection_reaches_the_caller_and_loses_nothing(llm: LLM) -> None:
    from pocketllm import UnsupportedOptionError

    with pytest.raises(UnsupportedOptionError, match="temperature"):
        llm.generate("x", SamplingParams(temperature=0.5))
    assert len(llm.generate("x", GREEDY)[0].outputs[0].token_ids) == 6


def test_async_stream_and_cancellation(pocketllm_tiny_llama: Path) -> None:
    async def main() -> None:
        llm = await asyncio.to_thread(AsyncLLM, str(pocketllm_tiny_llama), backend="echo")
        try:
            events = [e async for e in llm.generate("hello world", GREEDY)]
            assert events[-1].finish_reason == "length" and events[-1].usage.completion_tokens == 6
            out = await llm.complete("hello world", GREEDY)
            assert out.outputs[0].text == "".join(e.text for e in events)
            chat = await llm.chat([{"role": "user", "content": "hi"}], GREEDY)
            assert chat.outputs[0].finish_reason == "length"

            stream = llm.generate("a b", SamplingParams(temperature=0.0, max_tokens=10_000, ignore_eos=True))
            await anext(stream)
            await stream.aclose()  # closing the iterator cancels the request
            for _ in range(200):
                if llm.stats().num_running == 0:
                    break
                await asyncio.sleep(0.01)
            assert llm.stats().num_running == 0
        finally:
            llm.shutdown()

    asyncio.run(main())
