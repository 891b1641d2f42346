"""The conformance suite every backend runs against itself.

Subclass :class:`BackendConformance`, set ``backend`` (and ``engine_kwargs`` if
the backend needs some), and pytest collects these tests for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from pocketllm.errors import PromptTooLongError, UnsupportedOptionError
from pocketllm.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Hello there", "the cat sat on", "1 2 3 4", "A longer prompt about the sea and the ships on it"]


class BackendConformance:
    backend: ClassVar[str] = ""
    engine_kwargs: ClassVar[dict[str, Any]] = {}

    @pytest.fixture(scope="class")
    @classmethod
    def llm(cls, pocketllm_tiny_llama: Path) -> Iterator[Any]:
        llm = cls.make_llm(pocketllm_tiny_llama)
        yield llm
        llm.shutdown()

    @classmethod
    def make_llm(cls, path: Path, **overrides: Any) -> Any:
        from pocketllm.llm import LLM

        return LLM(str(path), backend=cls.backend, **{**cls.engine_kwargs, **overrides})

    def wait_idle(self, llm: Any, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = llm.driver.stats()
            if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_kv_blocks_used == 0:
                return
            time.sleep(0.01)
        raise AssertionError(f"engine did not go idle: {llm.driver.stats()}")

    def test_backend_is_selected(self, llm: Any) -> None:
        assert llm.backend_name == self.backend

    def test_generate(self, llm: Any) -> None:
        [out] = llm.generate(PROMPTS[0], GREEDY)
        choice = out.outputs[0]
        assert len(choice.token_ids) == GREEDY.max_tokens
        assert choice.finish_reason == "length"
        assert choice.text == llm.tokenizer.decode(choice.token_ids)
        assert out.usage.prompt_tokens == len(out.prompt_token_ids) == len(llm.tokenizer.encode(PROMPTS[0]))
        assert out.usage.completion_tokens == GREEDY.max_tokens
        self.wait_idle(llm)

    def test_token_id_prompt_equals_text_prompt(self, llm: Any) -> None:
        [by_text] = llm.generate(PROMPTS[1], GREEDY)
        [by_ids] = llm.generate(llm.tokenizer.encode(PROMPTS[1]), GREEDY)
        assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids

    def test_stream_matches_generate(self, llm: Any) -> None:
        [full] = llm.generate(PROMPTS[1], GREEDY)
        events = list(llm.generate_stream(PROMPTS[1], GREEDY))
        assert [t for e in events for t in e.token_ids] == full.outputs[0].token_ids
        assert "".join(e.text for e in events) == full.outputs[0].text
        assert events[-1].finish_reason == "length" and events[-1].usage is not None
        assert all(e.finish_reason is None for e in events[:-1])

    def test_max_tokens(self, llm: Any) -> None:
        for max_tokens in (1, 5):
            [out] = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
            assert len(out.outputs[0].token_ids) == max_tokens
            assert out.outputs[0].finish_reason == "length"

    def test_stop_string(self, llm: Any) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        text = llm.generate(PROMPTS[3], params)[0].outputs[0].text
        assert len(text) >= 6, f"need some text to pick a stop string from, got {text!r}"
        stop = text[3:5]
        [out] = llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]))
        choice = out.outputs[0]
        assert choice.text == text[:text.index(stop)]
        assert (choice.finish_reason, choice.stop_reason) == ("stop", stop)
        streamed = "".join(e.text for e in llm.generate_stream(
            PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])))
        assert streamed == choice.text
        self.wait_idle(llm)

    def test_abort_frees_the_request(self, llm: Any) -> None:
        stream = llm.generate_stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        next(stream)
        next(stream)
        stream.close()
        self.wait_idle(llm)
        [out] = llm.generate(PROMPTS[0], GREEDY)
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens

    def test_batch_equals_alone(self, llm: Any) -> None:
        batch = llm.generate(PROMPTS, GREEDY)
        alone = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
        assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]
        assert [o.prompt for o in batch] == PROMPTS

    def test_logprobs_shape(self, llm: Any) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
        if not llm.driver.capabilities.logprobs:
            with pytest.raises(UnsupportedOptionError) as err:
                llm.generate(PROMPTS[0], params)
            assert err.value.option == "logprobs" and err.value.backend == self.backend
            return
        [out] = llm.generate(PROMPTS[0], params)
        choice = out.outputs[0]
        assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids) == 4
        for token_id, lp in zip(choice.token_ids, choice.logprobs, strict=True):
            assert lp.token_id == token_id and lp.logprob <= 0.0 and lp.rank == 1
            assert len(lp.top) == 3
            assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
            assert lp.top[0].token_id == token_id and abs(lp.top[0].logprob - lp.logprob) < 1e-5

    def test_prompt_too_long(self, llm: Any) -> None:
        with pytest.raises(PromptTooLongError):
            llm.generate([1] * llm.args.max_model_len, GREEDY)

    @pytest.mark.parametrize(("option", "value"), [
        ("tensor_parallel_size", 2), ("speculative_method", "ngram"), ("backend_options", {"no_such_knob": 1}),
    ])
    def test_unsupported_option_is_a_typed_error(self, pocketllm_tiny_llama: Path, option: str, value: Any) -> None:
        with pytest.raises(UnsupportedOptionError) as err:
            self.make_llm(pocketllm_tiny_llama, **{option: value}).shutdown()
        assert err.value.option.startswith(option) and err.value.backend == self.backend
