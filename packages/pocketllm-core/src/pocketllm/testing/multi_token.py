"""Steps of several tokens (contract 3): what a backend whose steps give a request more than one token must keep.

The backend runs twice, with ``engine_kwargs`` (the reference) and with ``multi_token_kwargs`` added (the mode
in which its steps give several tokens: speculative decoding, or a test backend's own mode). Greedy outputs must
be the same token for token, and what ends a request inside a step (a stop string, a stop token, ``max_tokens``)
must end it at that token, with nothing after it streamed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from pocketllm.sampling_params import SamplingParams
from pocketllm.testing.protocol import LONG_PROMPT, PROMPTS, CheckpointKit

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


class MultiTokenConformance(CheckpointKit):
    """Subclass with ``backend``, ``multi_token_kwargs`` (and ``engine_kwargs`` for both runs, ``checkpoint``)."""

    multi_token_kwargs: ClassVar[dict[str, Any]] = {}

    @pytest.fixture(scope="class")
    @classmethod
    def single(cls, model_path: Path) -> Iterator[Any]:
        llm = cls.make_llm(model_path)
        yield llm
        llm.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def multi(cls, model_path: Path) -> Iterator[Any]:
        llm = cls.make_llm(model_path, **cls.multi_token_kwargs)
        yield llm
        llm.shutdown()

    @staticmethod
    def outputs(llm: Any, prompt: str, params: SamplingParams) -> list[tuple[Any, ...]]:
        [out] = llm.generate(prompt, params)
        return [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs]

    def test_steps_give_several_tokens(self, multi: Any) -> None:
        """Else every other check here proves nothing about several tokens."""
        events = list(multi.generate_stream(LONG_PROMPT, GREEDY))
        assert max(len(e.token_ids) for e in events) > 1, "no step gave more than one token"

    @pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 24])
    def test_greedy_output_and_length_match_single_steps(self, single: Any, multi: Any, max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for prompt in [*PROMPTS, LONG_PROMPT]:
            expected = self.outputs(single, prompt, params)
            assert self.outputs(multi, prompt, params) == expected
            assert len(expected[0][1]) == max_tokens

    def test_a_stop_string_inside_a_step_ends_the_output_at_its_token(self, single: Any, multi: Any) -> None:
        tokens = self.outputs(single, LONG_PROMPT, GREEDY)[0][1]
        for k, stop in _stop_strings(single, tokens):
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
            expected = self.outputs(single, LONG_PROMPT, params)
            assert expected[0][1] == tokens[:k + 1] and expected[0][2:] == ("stop", stop)
            assert self.outputs(multi, LONG_PROMPT, params) == expected
            events = list(multi.generate_stream(LONG_PROMPT, params))
            assert [t for e in events for t in e.token_ids] == expected[0][1], "tokens after the stop were streamed"
            assert "".join(e.text for e in events) == expected[0][0]
            assert events[-1].usage is not None and events[-1].usage.completion_tokens == k + 1

    def test_stop_tokens_and_min_tokens_inside_a_step(self, single: Any, multi: Any) -> None:
        tokens = self.outputs(single, LONG_PROMPT, GREEDY)[0][1]
        stop_id = tokens[5]
        for min_tokens in (0, 3, 8):
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_id],
                                    min_tokens=min_tokens)
            if "min_tokens" not in single.capabilities.sampling_options and min_tokens:
                continue
            assert self.outputs(multi, LONG_PROMPT, params) == self.outputs(single, LONG_PROMPT, params)

    def test_n_choices_and_a_batch_match_single_steps(self, single: Any, multi: Any) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, n=2, stop=["e"])
        expected = [[(c.text, c.token_ids) for c in out.outputs] for out in single.generate(PROMPTS, params)]
        assert [[(c.text, c.token_ids) for c in out.outputs] for out in multi.generate(PROMPTS, params)] == expected

    def test_logprobs_come_one_per_token(self, multi: Any) -> None:
        if not multi.capabilities.logprobs:
            pytest.skip(f"{self.backend} does not declare logprobs")
        params = SamplingParams(temperature=0.0, max_tokens=11, ignore_eos=True, logprobs=2)
        for event in multi.generate_stream(LONG_PROMPT, params):
            assert event.logprobs is not None and [lp.token_id for lp in event.logprobs] == event.token_ids


def _stop_strings(llm: Any, tokens: list[int]) -> list[tuple[int, str]]:
    """(k, s) pairs: a stop string s whose first match in the output ends inside token k, for a few k."""
    found: list[tuple[int, str]] = []
    for k in range(3, len(tokens) - 2):
        before, through = llm.tokenizer.decode(tokens[:k]), llm.tokenizer.decode(tokens[:k + 1])
        if len(through) < len(before) + 1 or not through.startswith(before):
            continue
        stop = through[max(0, len(before) - 1):]  # the token's text, and the character before it
        if through.find(stop) == len(through) - len(stop):
            found.append((k, stop))
        if len(found) == 3:
            break
    assert found, f"no stop string picks out a token of {tokens}"
    return found
