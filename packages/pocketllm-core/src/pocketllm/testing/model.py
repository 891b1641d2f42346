"""Model correctness: a backend that runs models reproduces transformers on the kit's checkpoints.

Greedy ids must equal the stored references exactly (their top-2 margins are far above rounding noise), the
top-5 logprobs must agree within the tolerance the backend declares, and a batch must give what each of its
requests gives alone. The reference prompts come in pairs that differ only early on and continue differently,
so an engine that mixes up KV caches between requests, or looks only at the last token, cannot pass.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from pocketllm.errors import UnsupportedOptionError
from pocketllm.sampling_params import SamplingParams
from pocketllm.testing import references
from pocketllm.testing.checkpoints import KIT_CHECKPOINTS
from pocketllm.testing.protocol import KitBase

REFERENCES = references.load()


class ModelConformance(KitBase):
    """Subclass with ``backend = "name"``; ``engine_kwargs`` should ask for float32 where the backend has it.

    ``logprob_tolerance`` is the largest absolute logprob difference the backend claims against transformers
    in float32."""

    logprob_tolerance: ClassVar[float] = 1e-3

    @pytest.fixture(scope="class", params=KIT_CHECKPOINTS)
    @classmethod
    def kit_model(cls, request: pytest.FixtureRequest, pocketllm_kit_checkpoint: Any) -> Iterator[tuple[str, Any]]:
        """``(checkpoint name, LLM)``; the LLM is None where the backend refused the checkpoint as it should."""
        kind = request.param
        path = pocketllm_kit_checkpoint(kind)
        assert references.tensors_sha256(path) == REFERENCES.checkpoints[kind].sha256, (
            f"the kit's {kind} checkpoint is not the one its references were computed on: "
            "regenerate them with `python -m pocketllm.testing.references`")
        try:
            llm = cls.make_llm(path)
        except UnsupportedOptionError as e:
            assert e.backend == cls.backend and e.option in ("model", "quantization"), e
            yield kind, None
            return
        yield kind, llm
        llm.shutdown()

    def generate(self, llm: Any, prompts: list[list[int]]) -> list[Any]:
        caps = llm.capabilities
        logprobs = REFERENCES.top_logprobs if caps.logprobs and caps.max_logprobs >= REFERENCES.top_logprobs else None
        params = SamplingParams(temperature=0.0, max_tokens=REFERENCES.max_tokens, ignore_eos=True, logprobs=logprobs)
        return [out.outputs[0] for out in llm.generate(prompts, params)]

    def test_greedy_ids_and_logprobs_match_transformers(self, kit_model: tuple[str, Any]) -> None:
        kind, llm = kit_model
        if llm is None:
            pytest.skip(f"{self.backend} refuses the {kind} checkpoint through its Capabilities")
        refs = REFERENCES.checkpoints[kind].references
        outputs = self.generate(llm, [r.prompt for r in refs])
        for i, (ref, out) in enumerate(zip(refs, outputs, strict=True)):
            assert out.token_ids == ref.token_ids, f"{kind} prompt {i}: greedy ids differ from transformers'"
            if out.logprobs is None:
                continue
            for step, (lp, top) in enumerate(zip(out.logprobs, ref.top_logprobs, strict=True)):
                ours = [t.logprob for t in lp.top]
                theirs = [value for _, value in top]
                worst = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
                assert worst <= self.logprob_tolerance, (
                    f"{kind} prompt {i} step {step}: top-{len(top)} logprobs {ours} vs transformers' {theirs}")
                assert abs(lp.logprob - theirs[0]) <= self.logprob_tolerance

    def test_batched_equals_alone(self, kit_model: tuple[str, Any]) -> None:
        kind, llm = kit_model
        if llm is None:
            pytest.skip(f"{self.backend} refuses the {kind} checkpoint through its Capabilities")
        prompts = [r.prompt for r in REFERENCES.checkpoints[kind].references]
        batched = [o.token_ids for o in self.generate(llm, prompts)]
        alone = [self.generate(llm, [p])[0].token_ids for p in prompts]
        assert batched == alone
