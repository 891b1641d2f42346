"""Protocol conformance: what every backend must do, whether or not it runs a model.

Everything is checked through the public ``LLM`` API on one of the kit's checkpoints, against the contract in
``pocketllm.backend``. Outputs are compared with the backend's own greedy output, never with fixed tokens, so
an engine that runs no model (the plugin guide's echo example) passes too. Options the backend's Capabilities leave
out must be refused with UnsupportedOptionError naming the option and the backend.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import msgspec.inspect
import pytest

from pocketllm.backend import SAMPLING_OPTIONS, Capabilities
from pocketllm.backend_options import BackendOptions
from pocketllm.errors import ConfigError, PromptTooLongError, UnsupportedOptionError
from pocketllm.limits import MAX_LOGPROBS, MAX_N
from pocketllm.plugins import BackendRegistry
from pocketllm.pooling import PoolingParams
from pocketllm.sampling_params import SamplingParams
from pocketllm.structured import StructuredOutputs
from pocketllm.testing.faults import FaultyAddBackend
from pocketllm.testing.hooks import engine_driver

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = ["Hello there", "the cat sat on", "1 2 3 4", "A longer prompt about the sea and the ships on it"]
LONG_PROMPT = " ".join(f"word{i}" for i in range(40))
# A non-default value for each optional sampling feature (see backend.SAMPLING_OPTIONS); sampling ones sample.
_OPTION_VALUES: dict[str, dict[str, Any]] = {
    "temperature": {"temperature": 0.8},
    "top_p": {"temperature": 0.8, "top_p": 0.5},
    "top_k": {"temperature": 0.8, "top_k": 5},
    "min_p": {"temperature": 0.8, "min_p": 0.1},
    "seed": {"temperature": 0.8, "seed": 1},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.3},
    "logit_bias": {"logit_bias": {5: 3.0}},
    "min_tokens": {"min_tokens": 2},
    "logprobs": {"logprobs": 2},
    "prompt_logprobs": {"prompt_logprobs": 2},
}
assert set(_OPTION_VALUES) == set(SAMPLING_OPTIONS)


class KitBase:
    """What both conformance classes share: the backend under test and how to build an LLM on it."""

    backend: ClassVar[str] = ""
    engine_kwargs: ClassVar[dict[str, Any]] = {}

    @classmethod
    def make_llm(cls, path: Path, registry: BackendRegistry | None = None, **overrides: Any) -> Any:
        from pocketllm.llm import LLM

        return LLM(str(path), registry=registry, **{"backend": cls.backend, **cls.engine_kwargs, **overrides})

    @staticmethod
    def wait_idle(llm: Any, timeout: float = 30.0) -> None:
        """Wait until no request runs or waits and no KV block is held: nothing a test did may leak."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = llm.stats()
            if stats.num_running == 0 and stats.num_waiting == 0 and stats.num_kv_blocks_used == 0:
                return
            time.sleep(0.01)
        raise AssertionError(f"engine did not go idle: {llm.stats()}")


class CheckpointKit(KitBase):
    """A kit class whose engines run one kit checkpoint: ``checkpoint`` picks it ("llama" or "qwen3", both
    safetensors)."""

    checkpoint: ClassVar[str] = "llama"

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, pocketllm_kit_checkpoint: Any) -> Path:
        return pocketllm_kit_checkpoint(cls.checkpoint)


class ProtocolConformance(CheckpointKit):
    """Subclass with ``backend = "name"`` (and ``engine_kwargs``, ``checkpoint``) to run the protocol checks on a
    backend."""

    @pytest.fixture(scope="class")
    @classmethod
    def llm(cls, model_path: Path) -> Iterator[Any]:
        llm = cls.make_llm(model_path)
        yield llm
        llm.shutdown()

    @pytest.fixture(autouse=True)
    def _leaves_nothing_behind(self, request: pytest.FixtureRequest) -> Iterator[None]:
        yield
        if "llm" in request.fixturenames:
            llm = request.getfixturevalue("llm")
            self.wait_idle(llm)
            assert engine_driver(llm).num_stray_deltas == 0, "the engine sent tokens for a finished or aborted request"

    @staticmethod
    def caps(llm: Any) -> Capabilities:
        return llm.capabilities

    def reference(self, llm: Any, prompt: str | list[int], max_tokens: int = 24) -> list[int]:
        [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        return out.outputs[0].token_ids

    @staticmethod
    def first_new_token(tokens: list[int], start: int = 2) -> int:
        """An index k >= start whose token does not occur before it (stop tokens end at their first occurrence)."""
        for k in range(start, len(tokens)):
            if tokens[k] not in tokens[:k]:
                return k
        pytest.fail(f"the greedy output {tokens} repeats too much to pick a stop token from")

    # -- basics ------------------------------------------------------------------------------------------------

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

    def test_length_finish_at_max_model_len(self, model_path: Path) -> None:
        llm = self.make_llm(model_path, max_model_len=24)
        try:
            prompt = llm.tokenizer.encode(PROMPTS[3])[:10]
            [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))
            assert len(out.outputs[0].token_ids) == 24 - len(prompt)
            assert out.outputs[0].finish_reason == "length"
            with pytest.raises(PromptTooLongError):
                llm.generate([prompt[0]] * 24, GREEDY)
            self.wait_idle(llm)
        finally:
            llm.shutdown()

    # -- ending a request ------------------------------------------------------------------------------------------

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

    def test_stop_token_ids(self, llm: Any) -> None:
        ref = self.reference(llm, PROMPTS[3])
        k = self.first_new_token(ref)
        [out] = llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[ref[k]]))
        choice = out.outputs[0]
        assert choice.token_ids == ref[:k + 1], "a stop token ends the request right after it, and is included"
        assert (choice.finish_reason, choice.stop_reason) == ("stop", ref[k])

    def test_eos(self, llm: Any, model_path: Path, tmp_path: Path) -> None:
        """The model's EOS ends a request (stop_reason None) unless ignore_eos; a token that is EOS and a
        requested stop token reports the stop token."""
        ref = self.reference(llm, PROMPTS[3])
        k = self.first_new_token(ref)
        eos_llm = self.make_llm(_with_eos(model_path, ref[k], tmp_path))
        try:
            [out] = eos_llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=24))
            choice = out.outputs[0]
            assert choice.token_ids == ref[:k + 1]
            assert (choice.finish_reason, choice.stop_reason) == ("stop", None)
            both = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[ref[k]])
            [out] = eos_llm.generate(PROMPTS[3], both)
            assert (out.outputs[0].token_ids, out.outputs[0].stop_reason) == (ref[:k + 1], ref[k])
            [out] = eos_llm.generate(PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
            assert out.outputs[0].token_ids == ref and out.outputs[0].finish_reason == "length"
            self.wait_idle(eos_llm)
        finally:
            eos_llm.shutdown()

    def test_min_tokens(self, llm: Any) -> None:
        ref = self.reference(llm, PROMPTS[3])
        k = self.first_new_token(ref)
        params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[ref[k]], min_tokens=k + 2)
        if "min_tokens" not in self.caps(llm).sampling_options:
            self.assert_refused(llm, params, "min_tokens")
            return
        [out] = llm.generate(PROMPTS[3], params)
        tokens = out.outputs[0].token_ids
        assert len(tokens) >= k + 2 and ref[k] not in tokens[:k + 2], "stop tokens are masked until min_tokens"
        assert tokens[:k] == ref[:k]
        if out.outputs[0].finish_reason == "stop":
            assert tokens[-1] == ref[k] == out.outputs[0].stop_reason and ref[k] not in tokens[:-1]

    # -- sampling -------------------------------------------------------------------------------------------------

    def assert_refused(self, llm: Any, params: SamplingParams, option: str) -> None:
        with pytest.raises(UnsupportedOptionError) as err:
            llm.generate(PROMPTS[0], params)
        assert (err.value.option, err.value.backend) == (option, llm.backend_name)

    @pytest.mark.parametrize("option", SAMPLING_OPTIONS)
    def test_sampling_option_is_honoured_or_refused(self, llm: Any, option: str) -> None:
        params = SamplingParams(max_tokens=4, **{"temperature": 0.0, **_OPTION_VALUES[option]})
        supported = self.caps(llm).sampling_options
        if option not in supported:
            # Truncation and seeds only exist for sampling: without it, sampling itself is what is refused.
            sampling = "temperature" in _OPTION_VALUES[option] and "temperature" not in supported
            self.assert_refused(llm, params, "temperature" if sampling else option)
            return
        [out] = llm.generate(PROMPTS[0], params)
        assert out.outputs[0].finish_reason in ("stop", "length") and out.outputs[0].token_ids
        # Where an option's effect is certain, it must show: a declared option must not be ignored.
        four = {"max_tokens": 4, "ignore_eos": True}
        if option == "logit_bias":
            [biased] = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, logit_bias={5: 100.0}, **four))
            assert biased.outputs[0].token_ids == [5] * 4, "a logit_bias of +100 must make its token the greedy one"
        narrow = {"top_k": {"top_k": 1}, "top_p": {"top_p": 1e-9}, "min_p": {"min_p": 1.0}}.get(option)
        if narrow is not None:
            [greedy] = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, **four))
            [drawn] = llm.generate(PROMPTS[0], SamplingParams(temperature=1.0, **narrow, **four))
            assert drawn.outputs[0].token_ids == greedy.outputs[0].token_ids, (
                f"{option} {narrow[option]} leaves only the most likely token: sampling must then be greedy")

    def test_declared_limits_are_refused_beyond(self, llm: Any) -> None:
        caps = self.caps(llm)
        cases = []
        if caps.logprobs and caps.max_logprobs < MAX_LOGPROBS:
            cases.append((SamplingParams(temperature=0.0, logprobs=caps.max_logprobs + 1), "logprobs"))
        if caps.max_n < MAX_N:
            cases.append((SamplingParams(temperature=0.0, n=caps.max_n + 1), "n"))
        if not cases:
            pytest.skip(f"{self.backend} declares the core's own limits on logprobs and n")
        for params, option in cases:
            self.assert_refused(llm, params, option)

    def test_seeds(self, llm: Any) -> None:
        """Same seed, same tokens (alone or in a batch, negative seeds too); different seeds, different tokens."""
        caps = self.caps(llm)
        base = {"temperature": 1.0, "max_tokens": 16, "ignore_eos": True}
        base |= {"top_p": 0.95} if "top_p" in caps.sampling_options else {}
        base |= {"top_k": 200} if "top_k" in caps.sampling_options else {}
        if not {"temperature", "seed"} <= set(caps.sampling_options):
            missing = "temperature" if "temperature" not in caps.sampling_options else "seed"
            self.assert_refused(llm, SamplingParams(**base, seed=5), missing)
            return

        def tokens(seed: int, batch: bool = False) -> list[int]:
            params = SamplingParams(**base, seed=seed)
            if not batch:
                return llm.generate(PROMPTS[1], params)[0].outputs[0].token_ids
            crowd = [SamplingParams(**base, seed=seed + 100 + i) for i in range(3)]
            return llm.generate([PROMPTS[1], *PROMPTS[:3]], [params, *crowd])[0].outputs[0].token_ids

        assert tokens(5) == tokens(5) == tokens(5, batch=True)
        assert tokens(-(2**63)) == tokens(-(2**63))
        assert len({tuple(tokens(seed)) for seed in (1, 2, 3, 4)}) > 1, "different seeds gave the same tokens"

    def test_seeded_sampling_ignores_the_rest_of_the_batch(self, llm: Any) -> None:
        """A seeded request samples the same tokens alone as among 8 mixed requests: other prompts and lengths,
        greedy, other seeds (its own seed on another prompt too) and no seed, whether all start together or the
        others join while it decodes (as on a busy server). Its greedy and seeded companions keep theirs too."""
        caps = self.caps(llm)
        if not {"temperature", "seed"} <= set(caps.sampling_options):
            pytest.skip(f"{self.backend} does not declare seeded sampling (test_seeds checks it refuses it)")
        truncate = {"top_k": 50} if "top_k" in caps.sampling_options else {}

        def sampled(temperature: float, seed: int | None, max_tokens: int) -> SamplingParams:
            return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                                  **truncate)

        def greedy(max_tokens: int) -> SamplingParams:
            return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

        target = (PROMPTS[1], sampled(0.8, 7, 40))
        crowd: list[tuple[str | list[int], SamplingParams]] = [
            (LONG_PROMPT, greedy(48)), (PROMPTS[2], sampled(1.0, 11, 44)), (PROMPTS[0], greedy(5)),
            (PROMPTS[3], sampled(0.8, 7, 12)), (PROMPTS[1] + " again", sampled(1.2, None, 20)),
            (llm.tokenizer.encode(PROMPTS[2])[:3], sampled(0.6, -3, 8)), (PROMPTS[1], greedy(16)),
        ]
        requests = [target, *crowd]
        reproducible = [i for i, (_, params) in enumerate(requests) if params.is_greedy or params.seed is not None]

        def tokens(outputs: list[Any]) -> list[list[int]]:
            return [o.outputs[0].token_ids for o in outputs]

        alone = {i: tokens(llm.generate(*requests[i]))[0] for i in reproducible}
        together = tokens(llm.generate([p for p, _ in requests], [params for _, params in requests]))
        # The long greedy one, a seeded one and the target start; the other five join while they decode.
        streams = [llm.generate_stream(*requests[i]) for i in (1, 2, 0)]
        started = [next(stream).token_ids for stream in streams]
        late = tokens(llm.generate([p for p, _ in requests[3:]], [params for _, params in requests[3:]]))
        rest = [[t for e in stream for t in e.token_ids] for stream in streams]
        first, second, own = (head + tail for head, tail in zip(started, rest, strict=True))
        joined = [own, first, second, *late]
        for i in reproducible:
            params = requests[i][1]
            what = f"request {i} ({'greedy' if params.is_greedy else f'seed {params.seed}'})"
            assert together[i] == alone[i], f"{what} sampled other tokens in a batch than alone"
            assert joined[i] == alone[i], f"{what} sampled other tokens with requests joining than alone"

    def test_n(self, llm: Any) -> None:
        if self.caps(llm).max_n < 3:
            pytest.skip("the backend declares fewer than 3 choices")
        single = self.reference(llm, PROMPTS[2], max_tokens=8)
        [out] = llm.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=3))
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.token_ids == single for c in out.outputs)
        assert out.usage.completion_tokens == 24
        if {"temperature", "seed"} <= set(self.caps(llm).sampling_options):
            def sampled(seed: int, n: int = 1) -> SamplingParams:
                return SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=seed, n=n)

            [fan] = llm.generate(PROMPTS[2], sampled(11, n=3))
            for i, choice in enumerate(fan.outputs):  # choice i draws with seed + i
                assert choice.token_ids == llm.generate(PROMPTS[2], sampled(11 + i))[0].outputs[0].token_ids

    def test_logprobs_shape(self, llm: Any) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)
        if not self.caps(llm).logprobs:
            self.assert_refused(llm, params, "logprobs")
            return
        [out] = llm.generate(PROMPTS[0], params)
        choice = out.outputs[0]
        assert choice.logprobs is not None and len(choice.logprobs) == len(choice.token_ids) == 4
        for token_id, lp in zip(choice.token_ids, choice.logprobs, strict=True):
            assert lp.token_id == token_id and lp.logprob <= 0.0 and lp.rank == 1
            assert len(lp.top) == 3
            assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
            assert lp.top[0].token_id == token_id and abs(lp.top[0].logprob - lp.logprob) < 1e-5

    def test_prompt_logprobs(self, llm: Any, model_path: Path) -> None:
        """The prompt's logprobs (None for its first token) are what generating each prefix's next token with
        logprobs says of it; the same chunked, with prefix caching on (the cache is bypassed), and for a request
        that only scores its prompt (max_tokens=0)."""
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
        if "prompt_logprobs" not in self.caps(llm).sampling_options:
            self.assert_refused(llm, params, "prompt_logprobs")
            return
        ids = llm.tokenizer.encode(LONG_PROMPT)[:24]
        [out] = llm.generate([ids], params)
        scored = out.prompt_logprobs
        assert scored is not None and len(scored) == len(ids) and scored[0] is None
        for i in (1, 5, len(ids) - 1):
            entry = scored[i]
            assert entry is not None and entry.token_id == ids[i] and len(entry.top) == 3
            [next_token] = llm.generate([ids[:i]], SamplingParams(temperature=0.0, max_tokens=1, logprobs=3))
            [generated] = next_token.outputs[0].logprobs
            assert [t.token_id for t in entry.top] == [t.token_id for t in generated.top]
            assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(entry.top, generated.top, strict=True))
            top_ids = [t.token_id for t in entry.top]
            assert entry.rank == (1 + top_ids.index(ids[i]) if ids[i] in top_ids else entry.rank) >= 1
        scoring = SamplingParams(max_tokens=0, prompt_logprobs=0)
        [only] = llm.generate([ids], scoring)
        assert only.outputs[0].token_ids == [] and only.outputs[0].finish_reason == "length"
        assert [e.logprob for e in only.prompt_logprobs[1:]] == pytest.approx([e.logprob for e in scored[1:]],
                                                                            abs=1e-3)
        other = self.make_llm(model_path, prefill_chunk_size=7, max_num_batched_tokens=16,
                              enable_prefix_caching=self.caps(llm).prefix_caching)
        try:
            for _ in range(2):  # the second run's prompt is in the prefix cache, where there is one
                [again] = other.generate([ids], params)
                assert [e.token_id for e in again.prompt_logprobs[1:]] == ids[1:]
                assert [e.logprob for e in again.prompt_logprobs[1:]] == pytest.approx(
                    [e.logprob for e in scored[1:]], abs=1e-3)
            self.wait_idle(other)
        finally:
            other.shutdown()

    # -- scheduling -----------------------------------------------------------------------------------------------

    def test_batch_equals_alone(self, llm: Any) -> None:
        batch = llm.generate(PROMPTS, GREEDY)
        alone = [llm.generate(p, GREEDY)[0] for p in PROMPTS]
        assert [o.outputs[0].token_ids for o in batch] == [o.outputs[0].token_ids for o in alone]
        assert [o.prompt for o in batch] == PROMPTS

    def test_requests_join_while_others_run(self, llm: Any) -> None:
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        expected = llm.generate(PROMPTS[3], long)[0].outputs[0].token_ids
        stream = llm.generate_stream(PROMPTS[3], long)
        first = next(stream).token_ids + next(stream).token_ids
        [joined] = llm.generate(PROMPTS[0], GREEDY)
        assert joined.outputs[0].token_ids == self.reference(llm, PROMPTS[0], GREEDY.max_tokens)
        assert first + [t for e in stream for t in e.token_ids] == expected

    def test_more_requests_than_max_num_seqs_queue(self, llm: Any, model_path: Path) -> None:
        prompts = [*PROMPTS, LONG_PROMPT]
        alone = [self.reference(llm, p, GREEDY.max_tokens) for p in prompts]
        small = self.make_llm(model_path, max_num_seqs=2)
        try:
            outs = small.generate(prompts, GREEDY)
            assert [o.outputs[0].token_ids for o in outs] == alone
            self.wait_idle(small)
        finally:
            small.shutdown()

    def test_prompt_longer_than_prefill_chunk(self, llm: Any, model_path: Path) -> None:
        expected = self.reference(llm, LONG_PROMPT, GREEDY.max_tokens)
        chunked = self.make_llm(model_path, prefill_chunk_size=7, max_num_batched_tokens=16)
        try:
            assert len(chunked.tokenizer.encode(LONG_PROMPT)) > 16
            outs = chunked.generate([LONG_PROMPT, PROMPTS[0]], GREEDY)
            assert outs[0].outputs[0].token_ids == expected
            self.wait_idle(chunked)
        finally:
            chunked.shutdown()

    def test_prefix_caching_keeps_outputs(self, llm: Any, model_path: Path) -> None:
        """With enable_prefix_caching, prompts sharing a long prefix (and a repeat of one) generate what they do
        without it, and a backend that reports prefix-cache stats counts hits. Small blocks and a small pool make
        the cache evict and reuse blocks across the runs."""
        if not self.caps(llm).prefix_caching:
            pytest.skip(f"{self.backend} does not declare prefix caching")
        prompts = [LONG_PROMPT + " and then", LONG_PROMPT + " but not", LONG_PROMPT + " and then", PROMPTS[1]]
        expected = [self.reference(llm, p, GREEDY.max_tokens) for p in prompts]
        cached = self.make_llm(model_path, enable_prefix_caching=True, max_num_seqs=2)
        try:
            for _ in range(2):
                for prompt, tokens in zip(prompts, expected, strict=True):
                    assert cached.generate(prompt, GREEDY)[0].outputs[0].token_ids == tokens
            assert [o.outputs[0].token_ids for o in cached.generate(prompts, GREEDY)] == expected
            stats = cached.stats()
            if stats.num_prefix_cache_queries:
                assert 0 < stats.num_prefix_cache_hits <= stats.num_prefix_cache_queries
            self.wait_idle(cached)
        finally:
            cached.shutdown()

    # -- cancellation and errors ----------------------------------------------------------------------------------

    def test_abort_running_request(self, llm: Any) -> None:
        stream = llm.generate_stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True))
        next(stream)
        next(stream)
        stream.close()
        self.wait_idle(llm)
        [out] = llm.generate(PROMPTS[0], GREEDY)
        assert len(out.outputs[0].token_ids) == GREEDY.max_tokens

    def test_abort_queued_request(self, model_path: Path) -> None:
        """A request aborted while it waits for a slot never runs: no token of it is ever produced."""
        llm = self.make_llm(model_path, max_num_seqs=1)
        try:
            endless = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
            running = llm.generate_stream(PROMPTS[0], endless)
            next(running)
            queued = llm.generate_stream(PROMPTS[1], endless)
            queued.close()  # it waits behind `running`, which holds the only slot
            next(running)
            running.close()
            self.wait_idle(llm)
            assert engine_driver(llm).num_stray_deltas == 0, "the aborted queued request ran anyway"
            [out] = llm.generate(PROMPTS[2], GREEDY)
            assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        finally:
            llm.shutdown()

    def test_typed_error_from_add_request_reaches_the_caller(self, model_path: Path) -> None:
        """The backend refuses the second choice of an n=2 request: the caller gets the backend's typed error,
        and the first choice, already added, is aborted and freed."""
        registry = BackendRegistry()
        faulty = FaultyAddBackend(registry.get(self.backend))
        registry.register_plugin(faulty.as_plugin(), name=faulty.name)
        llm = self.make_llm(model_path, registry=registry, backend=faulty.name)
        try:
            with pytest.raises(UnsupportedOptionError) as err:
                llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, n=2))
            assert (err.value.option, err.value.backend) == (FaultyAddBackend.OPTION, faulty.name)
            self.wait_idle(llm)
            [out] = llm.generate(PROMPTS[0], GREEDY)
            assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
        finally:
            llm.shutdown()

    def test_prompt_too_long(self, llm: Any) -> None:
        with pytest.raises(PromptTooLongError):
            llm.generate([5] * llm.args.max_model_len, GREEDY)

    def test_structured_outputs_are_honoured_or_refused(self, llm: Any) -> None:
        """A declared grammar holds even when sampling; an undeclared one is refused, never ignored."""
        spec = StructuredOutputs(choice=["cat", "dog and bird"])
        caps = self.caps(llm)
        sampled = {"temperature": 1.0} if "temperature" in caps.sampling_options else {"temperature": 0.0}
        params = SamplingParams(max_tokens=12, n=min(4, caps.max_n), structured_outputs=spec, **sampled)
        if not caps.structured_outputs:
            with pytest.raises(UnsupportedOptionError) as err:
                llm.generate(PROMPTS[0], params)
            assert err.value.option == "structured_outputs" and err.value.backend == self.backend
            return
        [out] = llm.generate(PROMPTS[0], params)
        assert all(c.text in spec.choice and c.finish_reason == "stop" for c in out.outputs), out.outputs

    def test_embeddings_are_honoured_or_refused(self, llm: Any, model_path: Path) -> None:
        """A backend that declares pooling types gives unit vectors of the model's width for each, equal for equal
        inputs, the same in a batch, in prompt chunks and beside a running generation as alone; one that does
        not refuses by name."""
        caps = self.caps(llm)
        if not caps.pooling_types:
            with pytest.raises(UnsupportedOptionError) as err:
                llm.embed(PROMPTS[0])
            assert err.value.option == "embeddings" and err.value.backend == self.backend
            return
        width = llm.model_config.hidden_size
        prompts = [*PROMPTS, LONG_PROMPT]
        chunked = self.make_llm(model_path, prefill_chunk_size=7, max_num_batched_tokens=16)
        try:
            for kind in caps.pooling_types:
                params = PoolingParams(pooling_type=kind)
                alone = [llm.embed(p, params)[0].embedding for p in prompts]
                for vector in alone:
                    assert len(vector) == width and abs(sum(x * x for x in vector) - 1.0) < 1e-4, kind
                assert llm.embed(PROMPTS[0], params)[0].embedding == alone[0], f"{kind}: same input, other vector"
                assert alone[0] != alone[1], f"{kind}: different inputs, one vector"
                for name, got in (("batched", llm.embed(prompts, params)), ("chunked", chunked.embed(prompts, params))):
                    for i, (out, vector) in enumerate(zip(got, alone, strict=True)):
                        worst = max(abs(a - b) for a, b in zip(out.embedding, vector, strict=True))
                        assert worst < 1e-4, f"{kind}: prompt {i} {name} differs from alone by {worst}"
                raw = llm.embed(PROMPTS[1], PoolingParams(pooling_type=kind, normalize=False))[0].embedding
                norm = sum(x * x for x in raw) ** 0.5
                assert max(abs(a / norm - b) for a, b in zip(raw, alone[1], strict=True)) < 1e-4
            long = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
            expected = self.reference(llm, PROMPTS[3], long.max_tokens)
            stream = llm.generate_stream(PROMPTS[3], long)
            first = next(stream).token_ids
            beside = llm.embed(prompts)
            assert first + [t for e in stream for t in e.token_ids] == expected, "an embedding disturbed a generation"
            for out, vector in zip(beside, llm.embed(prompts), strict=True):
                assert max(abs(a - b) for a, b in zip(out.embedding, vector.embedding, strict=True)) < 1e-4
            with pytest.raises(UnsupportedOptionError) as err:
                llm.embed(PROMPTS[0], PoolingParams(dimensions=width + 1))
            assert err.value.option == "dimensions"
            self.wait_idle(chunked)
        finally:
            chunked.shutdown()

    @pytest.mark.parametrize("option", ["tensor_parallel_size", "speculative_method", "backend_options",
                                        "enable_prefix_caching", "dtype", "kv_cache_dtype", "max_num_seqs"])
    def test_unsupported_engine_option_is_a_typed_error(self, llm: Any, model_path: Path, option: str) -> None:
        caps = self.caps(llm)
        value = _unsupported_value(caps, option)
        if value is None:
            pytest.skip(f"{self.backend} supports every value of {option} this test tries")
        overrides = {option: value}
        if option == "speculative_method":  # the method's own settings, so that the method alone is refused
            overrides |= {"num_speculative_tokens": 2, **({"draft_model": str(model_path)} if value == "draft_model"
                                                         else {})}
        with pytest.raises(UnsupportedOptionError) as err:
            self.make_llm(model_path, **overrides).shutdown()
        assert err.value.option.startswith(option) and err.value.backend == self.backend

    def test_backend_options_of_a_wrong_type_or_out_of_range_are_config_errors(self, llm: Any,
                                                                              model_path: Path) -> None:
        """Each option the backend declares refuses a value of another type (true where it takes an integer)
        and each bound of its range, with a ConfigError naming the key and the backend."""
        values = _bad_option_values(self.caps(llm).backend_options)
        if not values:
            pytest.skip(f"{self.backend} declares no backend options")
        for key, value in values:
            with pytest.raises(ConfigError) as err:
                self.make_llm(model_path, backend_options={key: value}).shutdown()
            assert err.value.field == f"backend_options.{key}", (key, value)
            assert f"backend {self.backend!r}" in str(err.value), (key, value)


def _bad_option_values(spec: type[BackendOptions]) -> list[tuple[str, Any]]:
    """For each field of ``spec``: a list (no option's type here takes one), true for an integer field and 1 for a
    boolean one (neither passes for the other), and the values just outside each bound of a number's range."""
    values: list[tuple[str, Any]] = []
    info = msgspec.inspect.type_info(spec)
    assert isinstance(info, msgspec.inspect.StructType)
    for field in info.fields:
        union = field.type.types if isinstance(field.type, msgspec.inspect.UnionType) else (field.type,)
        kinds = [t.type if isinstance(t, msgspec.inspect.Metadata) else t for t in union]
        if not any(isinstance(t, msgspec.inspect.ListType) for t in kinds):
            values.append((field.encode_name, []))
        ints, bools = (any(isinstance(t, kind) for t in kinds)
                       for kind in (msgspec.inspect.IntType, msgspec.inspect.BoolType))
        if ints != bools:
            values.append((field.encode_name, True if ints else 1))
        for t in kinds:
            if isinstance(t, msgspec.inspect.IntType | msgspec.inspect.FloatType):
                step = 1 if isinstance(t, msgspec.inspect.IntType) else 1e-3
                bounds = [t.gt, None if t.ge is None else t.ge - step, t.lt, None if t.le is None else t.le + step]
                values += [(field.encode_name, bound) for bound in bounds if bound is not None]
    return values


def _unsupported_value(caps: Capabilities, option: str) -> Any:
    """A value of an EngineArgs field that ``caps`` rules out, or None when it rules out none of those tried."""
    if option == "tensor_parallel_size":
        return None if caps.tensor_parallel else 2
    if option == "speculative_method":
        return next((m for m in ("ngram", "mtp", "draft_model") if m not in caps.speculative_methods), None)
    if option == "backend_options":
        return {"no_such_knob_in_any_backend": 1}
    if option == "enable_prefix_caching":
        return None if caps.prefix_caching else True
    if option == "dtype":
        return next((d for d in ("float16", "bfloat16", "float32") if d not in caps.dtypes), None)
    if option == "kv_cache_dtype":
        return next((d for d in ("fp8_e5m2", "float16", "float32") if d not in caps.kv_cache_dtypes), None)
    return None if caps.max_num_seqs is None else caps.max_num_seqs + 1


def _with_eos(model_path: Path, eos: int, tmp_path: Path) -> Path:
    """The same checkpoint with another EOS id: links to its files, and a config.json that says so."""
    variant = tmp_path / "eos-variant"
    variant.mkdir()
    for item in model_path.iterdir():
        if item.name != "config.json":
            (variant / item.name).symlink_to(item)
    config = json.loads((model_path / "config.json").read_text())
    (variant / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    return variant
