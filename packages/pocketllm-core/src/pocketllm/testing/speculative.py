"""Speculative decoding (contract 3): what a backend that lists a method in ``Capabilities.speculative_methods``
keeps (see "Speculative decoding" in pocketllm.backend).

The backend runs with and without speculation on a checkpoint that mostly repeats itself (``*-cyclic`` in
``checkpoints.SPECULATIVE_CHECKPOINTS``; ``qwen3_5-cyclic-mtp`` adds a multi-token-prediction head that predicts
the same cycle, for ``mtp``), so that drafts are accepted in runs and sometimes rejected. Every check of
``MultiTokenConformance`` runs (greedy outputs equal token for token; stops, stop tokens, ``min_tokens`` and
``max_tokens`` inside an accepted run end it at that token), and these: drafts are counted; a seed reproduces its
tokens alone and in any batch; drafting and non-drafting requests share a batch; an abort inside an accepted run
leaves nothing behind; prefix caching changes nothing.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, ClassVar

import pytest

from pocketllm.sampling_params import SamplingParams
from pocketllm.structured import StructuredOutputs
from pocketllm.testing.multi_token import GREEDY, MultiTokenConformance
from pocketllm.testing.protocol import LONG_PROMPT, PROMPTS

SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=11)


class SpeculativeConformance(MultiTokenConformance):
    """Subclass with ``backend``, ``checkpoint`` (one of SPECULATIVE_CHECKPOINTS) and ``multi_token_kwargs`` (the
    method and its settings)."""

    checkpoint: ClassVar[str] = "llama-cyclic"
    multi_token_kwargs: ClassVar[dict[str, Any]] = {"speculative_method": "ngram", "num_speculative_tokens": 4}

    def test_drafts_are_counted(self, multi: Any) -> None:
        before = multi.stats()
        self.outputs(multi, LONG_PROMPT, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
        stats = multi.stats()
        drafts = stats.num_spec_drafts - before.num_spec_drafts
        drafted = stats.num_spec_draft_tokens - before.num_spec_draft_tokens
        accepted = stats.num_spec_accepted_tokens - before.num_spec_accepted_tokens
        assert 0 < drafts <= drafted and 0 < accepted <= drafted
        per_position = stats.spec_accepted_per_position
        assert len(per_position) == self.multi_token_kwargs["num_speculative_tokens"]
        assert sum(per_position) == stats.num_spec_accepted_tokens
        assert all(a >= b for a, b in itertools.pairwise(per_position)), per_position

    def test_a_seed_gives_its_tokens_alone_and_in_any_batch(self, multi: Any) -> None:
        alone = self.outputs(multi, LONG_PROMPT, SAMPLED)
        assert self.outputs(multi, LONG_PROMPT, SAMPLED) == alone
        others = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=s) for s in range(len(PROMPTS))]
        outs = multi.generate([*PROMPTS, LONG_PROMPT], [*others, SAMPLED])
        got = [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in outs[-1].outputs]
        assert got == alone

    def test_drafting_and_constrained_requests_share_a_batch(self, single: Any, multi: Any) -> None:
        """Greedy requests that draft beside ones that may not (a grammar's, where the backend has grammars)."""
        params = [GREEDY] * len(PROMPTS)
        if multi.capabilities.structured_outputs:
            params[0] = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputs(
                regex="(ab|cd)+e"))
        expected = [out.outputs[0].token_ids for out in single.generate(PROMPTS, params)]
        assert [out.outputs[0].token_ids for out in multi.generate(PROMPTS, params)] == expected

    def test_an_abort_inside_an_accepted_run_leaves_nothing_behind(self, single: Any, multi: Any) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
        stream = multi.generate_stream(LONG_PROMPT, params)
        seen = 0
        for event in stream:
            seen += len(event.token_ids)
            if len(event.token_ids) > 1:
                break
        stream.close()
        assert seen < 48, "no step gave several tokens before the end"
        self.wait_idle(multi)
        assert self.outputs(multi, LONG_PROMPT, params) == self.outputs(single, LONG_PROMPT, params)

    def test_prefix_caching_changes_nothing(self, single: Any, model_path: Path) -> None:
        if not single.capabilities.prefix_caching:
            pytest.skip(f"{self.backend} has no prefix caching")
        cached = self.make_llm(model_path, **self.multi_token_kwargs, enable_prefix_caching=True)
        try:
            prompts = [LONG_PROMPT, LONG_PROMPT + " word40", LONG_PROMPT]
            expected = [self.outputs(single, p, GREEDY) for p in prompts]
            assert [self.outputs(cached, p, GREEDY) for p in prompts] == expected
            assert cached.stats().num_prefix_cache_hits > 0
        finally:
            cached.shutdown()
