"""The output processor under multi-token steps (contract 3): a delta of k tokens gives the same text, tokens,
reasoning split and finish as k deltas of one, and what ends a choice inside a delta drops the tokens after it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pocketllm.backend import RequestDelta, SampledLogprobs, TokenLogprob
from pocketllm.detokenizer import IncrementalDetokenizer, StopMatcher
from pocketllm.errors import EngineDeadError, RequestFailedError
from pocketllm.output_processor import MAX_STRAY_REQUESTS, OutputProcessor, RequestState, new_choice
from pocketllm.outputs import StreamEvent
from pocketllm.sampling_params import SamplingParams

PIECES = ["<think>", "a", "b", "</think>", "\n\n", "Hel", "lo", " wor", "ld", "!", " Bye", "."]


class ScriptedTokenizer:
    """Token i is PIECES[i]."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(PIECES[i] for i in ids)


def run(tokens: list[int], chunk: int, finish: str | None = "length", **params: Any) -> tuple[
        list[StreamEvent], list[str]]:
    """Feed ``tokens`` in deltas of ``chunk`` (the last one finishing with ``finish``); the events and the
    engine requests the processor dropped."""
    sampling = SamplingParams(max_tokens=params.pop("max_tokens", len(tokens)), **params)
    events: list[StreamEvent] = []
    choice = new_choice(0, "r", IncrementalDetokenizer(ScriptedTokenizer(), [0], True), sampling)  # type: ignore[arg-type]
    request = RequestState("r", [0], sampling, events.append, StopMatcher(sampling.stop, False), [choice])
    processor = OutputProcessor(lambda r, c: None, lambda r: None)
    processor.choices["r"] = (request, choice)
    dropped: list[str] = []
    for start in range(0, len(tokens), chunk):
        if "r" not in processor.choices:
            break
        part = tokens[start:start + chunk]
        last = start + chunk >= len(tokens)
        logprobs = [SampledLogprobs(t, -float(t), 1, []) for t in part]
        dropped += processor.process([RequestDelta(request_id="r", new_token_ids=part, logprobs=logprobs,
                                                   finish_reason=finish if last else None)])
    return events, dropped


def whole(events: list[StreamEvent]) -> dict[str, Any]:
    return {"text": "".join(e.text for e in events), "tokens": [t for e in events for t in e.token_ids],
            "logprobs": [lp.token_id for e in events for lp in e.logprobs or []],
            "reasoning": "".join(e.reasoning or "" for e in events), "answer": "".join(e.answer or "" for e in events),
            "finish": events[-1].finish_reason, "stop": events[-1].stop_reason,
            "reasoning_tokens": events[-1].reasoning_tokens, "usage": events[-1].usage}


ANSWER = list(range(5, len(PIECES)))


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, len(PIECES)])
def test_a_stop_string_inside_a_delta_ends_the_choice_at_its_token(chunk: int) -> None:
    events, dropped = run(ANSWER, chunk, stop=["wor"])
    assert whole(events) | {"usage": None} == {
        "text": "Hello ", "tokens": [5, 6, 7], "logprobs": [5, 6, 7], "reasoning": "", "answer": "", "finish": "stop",
        "stop": "wor", "reasoning_tokens": None, "usage": None}
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 3
    # The engine still ran it, unless the delta with the stop string was its last: then it must drop it.
    assert dropped == ([] if 2 // chunk == (len(ANSWER) - 1) // chunk else ["r"])


@pytest.mark.parametrize("chunk", [1, 2, 4, len(PIECES)])
def test_stop_strings_wait_for_min_tokens_inside_a_delta(chunk: int) -> None:
    events, _ = run(ANSWER, chunk, stop=["l"], min_tokens=4)
    # "Hel" and "lo" hold an "l" before 4 tokens are out; the first one after is in " wor" + "ld".
    assert whole(events)["text"] == "Hello wor" and whole(events)["tokens"] == [5, 6, 7, 8]


@pytest.mark.parametrize("chunk", [1, 3, len(PIECES)])
def test_an_engine_that_overruns_max_tokens_is_held_to_it(chunk: int) -> None:
    events, dropped = run(ANSWER, chunk, finish=None, max_tokens=3)
    assert whole(events)["text"] == "Hello wor" and whole(events)["tokens"] == [5, 6, 7]
    assert whole(events)["finish"] == "length" and dropped == ["r"]


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, len(PIECES)])
def test_the_reasoning_split_and_its_token_count_do_not_depend_on_the_step_size(chunk: int) -> None:
    events, dropped = run(list(range(len(PIECES))), chunk, finish="stop", reasoning="qwen3", stop=["!"])
    result = whole(events)
    assert (result["reasoning"], result["answer"], result["reasoning_tokens"]) == ("ab", "Hello world", 4)
    assert result["text"] == "<think>ab</think>\n\nHello world" and result["stop"] == "!"
    assert result["usage"].reasoning_tokens == 4 and result["usage"].completion_tokens == 10
    assert dropped == ([] if 9 // chunk == (len(PIECES) - 1) // chunk else ["r"])  # a finished one needs none


def test_a_reply_without_a_section_has_no_reasoning_tokens() -> None:
    events, _ = run(ANSWER, 3, reasoning="qwen3")
    assert whole(events)["reasoning_tokens"] == 0 and whole(events)["answer"] == "Hello world! Bye."


def test_a_section_never_closed_is_all_reasoning() -> None:
    events, _ = run([0, 1, 2], 2, reasoning="qwen3")
    assert (whole(events)["reasoning"], whole(events)["answer"], whole(events)["reasoning_tokens"]) == ("ab", "", 3)


def test_stop_in_reasoning_looks_for_stop_strings_in_the_section_too() -> None:
    events, _ = run(list(range(len(PIECES))), 4, reasoning="qwen3", stop=["b"], stop_in_reasoning=True)
    assert whole(events)["text"] == "<think>a" and whole(events)["reasoning"] == "a"


@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_the_library_returns_the_reply_split_the_same_whole_and_streamed(pocketllm_tiny_llama,
                                                                         tokens_per_step: int) -> None:
    """The echo backend replays the prompt, so a prompt scripts the reply."""
    from pocketllm import LLM

    llm = LLM(str(pocketllm_tiny_llama), backend="echo", backend_options={"tokens_per_step": tokens_per_step})
    try:
        reply = "<think>weigh it</think>\n\nThe answer."
        params = SamplingParams(temperature=0.0, max_tokens=len(llm.tokenizer.encode(reply)), reasoning="qwen3")
        [out] = llm.generate(reply, params)
        choice = out.outputs[0]
        assert choice.text.startswith(reply[:12]) and (choice.reasoning, choice.answer) == ("weigh it", "The answer.")
        assert 0 < choice.reasoning_tokens == out.usage.reasoning_tokens < len(choice.token_ids)
        events = list(llm.generate_stream(reply, params))
        assert "".join(e.reasoning or "" for e in events) == choice.reasoning
        assert "".join(e.answer or "" for e in events) == choice.answer
        assert events[-1].reasoning_tokens == choice.reasoning_tokens
        [plain] = llm.generate(reply, SamplingParams(temperature=0.0, max_tokens=4))
        assert (plain.outputs[0].reasoning, plain.outputs[0].answer, plain.usage.reasoning_tokens) == (None, None, None)
    finally:
        llm.shutdown()


def test_a_delta_that_ends_a_choice_without_a_token_ends_it() -> None:
    """An engine may end a request between tokens (say, aborting it as too long): nothing may hang on it."""
    sampling = SamplingParams(max_tokens=10)
    sink: list[StreamEvent] = []
    choice = new_choice(0, "r", IncrementalDetokenizer(ScriptedTokenizer(), [0], True), sampling)  # type: ignore[arg-type]
    request = RequestState("r", [0], sampling, sink.append, StopMatcher([], False), [choice])
    processor = OutputProcessor(lambda r, c: None, lambda r: None)
    processor.choices["r"] = (request, choice)
    processor.process([RequestDelta(request_id="r", new_token_ids=[5, 6])])
    assert processor.process([RequestDelta(request_id="r", new_token_ids=[], finish_reason="length")]) == []
    assert sink[-1].finish_reason == "length" and sink[-1].usage is not None and "r" not in processor.choices
    assert "".join(e.text for e in sink) == "Hello"


@pytest.mark.parametrize(("sent", "fails"), [(None, True), ([], True), ([SampledLogprobs(7, -1.0, 1, [])] * 2, False),
                                             ([SampledLogprobs(7, -1.0, 1, [])] * 3, True)])
def test_a_backend_that_declares_prompt_logprobs_but_sends_the_wrong_number_fails_the_request(
        sent: list[SampledLogprobs] | None, fails: bool) -> None:
    """A 3-token prompt scored with its first tokens: two entries (the first token has none) and the prompt's
    logprobs lead with None; anything else is a broken contract, and the request fails rather than come back
    silently unscored."""
    sampling = SamplingParams(max_tokens=4, prompt_logprobs=0)
    sink: list[Any] = []
    choice = new_choice(0, "r", IncrementalDetokenizer(ScriptedTokenizer(), [0, 1, 2], True), sampling)  # type: ignore[arg-type]
    request = RequestState("r", [0, 1, 2], sampling, sink.append, StopMatcher([], False), [choice])
    processor = OutputProcessor(lambda r, c: None, lambda r: None)
    processor.choices["r"] = (request, choice)
    processor.process([RequestDelta(request_id="r", new_token_ids=[5], prompt_logprobs=sent)])
    if fails:
        assert isinstance(sink[-1], Exception) and "prompt logprobs" in str(sink[-1])
    else:
        assert sink[-1].prompt_logprobs == [None, *sent]


def test_an_engine_that_goes_on_sending_deltas_for_a_dropped_request_is_broken() -> None:
    """One delta out of turn is counted and logged; a second for the same request (the engine never dropped it), or
    deltas for too many requests, end the engine, naming its backend: such an engine flooded the log and kept the
    engine thread busy for ever."""
    processor = OutputProcessor(lambda r, c: None, lambda r: None, "flawed")
    processor.process([RequestDelta(request_id="gone", new_token_ids=[1])])
    assert processor.num_stray_deltas == 1
    with pytest.raises(EngineDeadError, match="backend 'flawed' went on sending deltas for request gone"):
        processor.process([RequestDelta(request_id="gone", new_token_ids=[1])])
    many = OutputProcessor(lambda r, c: None, lambda r: None, "flawed")
    many.process([RequestDelta(request_id=f"r{i}", new_token_ids=[1]) for i in range(MAX_STRAY_REQUESTS)])
    with pytest.raises(EngineDeadError):
        many.process([RequestDelta(request_id="one-more", new_token_ids=[1])])


@pytest.mark.parametrize(("delta", "message"), [
    (RequestDelta(request_id="r", new_token_ids=[np.int64(3)]), "Python ints, got int64"),
    (RequestDelta(request_id="r", new_token_ids=[3, 12]), "token id 12, outside the vocabulary [0, 12)"),
    (RequestDelta(request_id="r", new_token_ids=[-1]), "token id -1, outside"),
    (RequestDelta(request_id="r", new_token_ids=[3], logprobs=[SampledLogprobs(3, np.float32(-0.5), 1, [])]),
     "Python floats, got float32"),
    (RequestDelta(request_id="r", new_token_ids=[3], logprobs=[SampledLogprobs(3, -0.5, 1, (TokenLogprob(3, -0.5),))]),
     "whose top is a list of TokenLogprob"),
    (RequestDelta(request_id="r", new_token_ids=[3],
                  logprobs=[SampledLogprobs(3, -0.5, 1, [TokenLogprob(3, np.float32(-0.5))])]),
     "whose top is a list of TokenLogprob"),
])
def test_a_delta_outside_the_contract_fails_its_request_naming_the_backend(delta: RequestDelta, message: str) -> None:
    """NumPy scalars (an engine written in NumPy) reached users as such and failed the server's JSON in the middle
    of a reply; an id past the vocabulary passed silently."""
    sampling = SamplingParams(max_tokens=4)
    events: list[Any] = []
    choice = new_choice(0, "r", IncrementalDetokenizer(ScriptedTokenizer(), [0], True), sampling)  # type: ignore[arg-type]
    request = RequestState("r", [0], sampling, events.append, StopMatcher([], False), [choice])
    processor = OutputProcessor(lambda r, c: None, lambda r: None, "numpy", vocab_size=len(PIECES))
    processor.choices["r"] = (request, choice)
    processor.process([delta])
    [error] = events
    assert isinstance(error, RequestFailedError) and "backend 'numpy'" in str(error) and message in str(error)
