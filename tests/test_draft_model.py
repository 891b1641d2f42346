"""Speculative decoding with a draft model, on each backend: a smaller model of the same vocabulary drafts, its keys
and values in a cache indexed by the target's block tables; greedy and seeded outputs are the target's own, under
preemption and prefix caching too; a draft model that cannot draft is refused at load, naming the option."""

from __future__ import annotations

from pathlib import Path

import pytest

from pocketllm import LLM, SamplingParams
from pocketllm.errors import CheckpointError, ConfigError, UnsupportedOptionError
from pocketllm.testing.protocol import LONG_PROMPT, PROMPTS

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=40, ignore_eos=True, seed=3)


# Each backend in its default arithmetic but torch's, float32 (bfloat16 rounds the kit's tiny margins): every
# comparison is with the same backend without drafts.
ARGS = {"torch": {"dtype": "float32"}, "cpp": {}}


@pytest.fixture(params=list(ARGS))
def backend(request: pytest.FixtureRequest) -> str:
    pytest.importorskip(f"pocketllm_{request.param}")
    return request.param


def make(path: Path, backend: str, **kwargs: object) -> LLM:
    return LLM(str(path), backend=backend, **ARGS[backend], **kwargs)


def drafting(target: Path, draft: Path, backend: str, **kwargs: object) -> LLM:
    return make(target, backend, speculative_method="draft_model", draft_model=str(draft), num_speculative_tokens=4,
                **kwargs)


def outputs(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    prompts = [LONG_PROMPT, *PROMPTS]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, [params] * len(prompts))]


@pytest.fixture(scope="module")
def pair(pocketllm_kit_checkpoint) -> tuple[Path, Path]:
    """The cyclic Qwen3 as the target and the cyclic Llama, which follows the same cycles, as its draft model."""
    return pocketllm_kit_checkpoint("qwen3-cyclic"), pocketllm_kit_checkpoint("llama-cyclic")


def test_a_draft_model_s_drafts_are_accepted_and_change_no_token(pair: tuple[Path, Path], backend: str) -> None:
    target, draft = pair
    plain, spec = make(target, backend), drafting(target, draft, backend)
    try:
        assert outputs(spec) == outputs(plain)
        assert outputs(spec, SEEDED) == outputs(plain, SEEDED)
        stats = spec.stats()
        assert stats.num_spec_accepted_tokens > 0.5 * stats.num_spec_draft_tokens
    finally:
        plain.shutdown()
        spec.shutdown()


@pytest.mark.parametrize("kwargs", [{"backend_options": {"num_kv_blocks": 24}, "max_model_len": 384},
                                    {"enable_prefix_caching": True, "prefill_chunk_size": 64}],
                         ids=["preempted", "prefix-cached"])
def test_preemption_and_prefix_caching_change_nothing(pair: tuple[Path, Path], kwargs: dict[str, object],
                                                     backend: str) -> None:
    """Preempted sequences recompute both models' caches; cached prefixes are run by the draft model again, a
    prompt chunk at a time."""
    target, draft = pair
    plain = make(target, backend, max_model_len=384)
    expected = outputs(plain) + outputs(plain)
    plain.shutdown()
    spec = drafting(target, draft, backend, **({"max_model_len": 384} | kwargs))
    try:
        assert outputs(spec) + outputs(spec) == expected
        stats = spec.stats()
        assert stats.num_preemptions > 0 if "backend_options" in kwargs else stats.num_prefix_cache_hits > 0
    finally:
        spec.shutdown()


def test_a_draft_model_that_cannot_draft_is_refused(pair: tuple[Path, Path], pocketllm_kit_checkpoint,
                                                    tmp_path: Path, backend: str) -> None:
    target, draft = pair
    with pytest.raises(UnsupportedOptionError, match=r"draft_model.*state layers"):
        drafting(target, pocketllm_kit_checkpoint("qwen3_5-cyclic"), backend)
    if backend == "torch":  # cpp has no tensor parallelism at all
        with pytest.raises(UnsupportedOptionError, match="tensor_parallel_size"):
            drafting(target, draft, backend, tensor_parallel_size=2)
    with pytest.raises(ConfigError, match=r"draft_model.*vocabulary"):
        drafting(target, _other_vocabulary(draft, tmp_path), backend)
    with pytest.raises(CheckpointError, match=r"draft_model: .*missing"):
        drafting(target, tmp_path / "missing", backend)


def _other_vocabulary(path: Path, tmp_path: Path) -> Path:
    """The draft model with one more row in its embedding and head: a vocabulary the target does not have."""
    import json
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    copy = tmp_path / "bigger"
    shutil.copytree(path, copy)
    config = json.loads((copy / "config.json").read_text())
    config["vocab_size"] += 1
    (copy / "config.json").write_text(json.dumps(config))
    weights = load_file(str(copy / "model.safetensors"))
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        weights[name] = np.concatenate([weights[name], weights[name][:1]])
    save_file(weights, str(copy / "model.safetensors"))
    return copy
