"""A request's numbers do not depend on what else runs in its steps: a seeded request samples the same tokens,
with the same logprobs to the bit, alone and on a busy server.

The kit checks tokens (ProtocolConformance.test_seeded_sampling_ignores_the_rest_of_the_batch) on safetensors
checkpoints; these check logprobs on GGUF ones, whose 4-bit matrices went through a dense copy beyond 16 rows:
a short prompt prefilled beside others, or a decode step of more than 16 sequences, computed the request's rows
with another kernel than alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pocketllm import LLM, SamplingParams
from tests.conftest import requires_default_model

pytest.importorskip("pocketllm_torch")

SEEDED = SamplingParams(temperature=0.8, seed=1234, max_tokens=24, ignore_eos=True, logprobs=3)
PROMPT = "Write a short story about a robot who learns to paint."
OTHERS = ["Hi", "Tell me about the ocean and the creatures that live in it, from the top to the deepest trench",
          "1 2 3", "The capital of France is", "Once upon a time", "List ten fruits:"]


def logprobs(out: Any) -> list[tuple[int, float, list[tuple[int, float]]]]:
    return [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in out.outputs[0].logprobs]


def crowd(size: int) -> tuple[list[str], list[SamplingParams]]:
    """``size`` other requests: greedy and sampled, other seeds and none, short and long."""
    prompts = [OTHERS[i % len(OTHERS)] + " " * (i // len(OTHERS)) for i in range(size)]
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0, seed=i if i % 3 == 1 else None,
                             max_tokens=8 + 3 * i, ignore_eos=True) for i in range(size)]
    return prompts, params


def assert_alone_equals_busy(llm: LLM, prompt: str) -> None:
    alone = logprobs(llm.generate(prompt, SEEDED)[0])
    # 20 others: their prompts share the seeded one's prefill step, and 21 sequences decode together.
    prompts, params = crowd(20)
    together = llm.generate([prompt, *prompts], [SEEDED, *params])[0]
    assert logprobs(together) == alone, "prefilled and decoded beside 20 others"
    # Requests joining while it decodes: their prefill steps come between its decode steps.
    stream = llm.generate_stream(prompt, SEEDED)
    events = [next(stream)]
    llm.generate(*crowd(8))
    events += list(stream)
    assert [(lp.token_id, lp.logprob) for e in events for lp in e.logprobs or []] == [lp[:2] for lp in alone]


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_gguf_request_has_the_same_logprobs_alone_and_in_a_busy_batch(
        dtype: str, pocketllm_kit_checkpoint: Callable[[str], Path]) -> None:
    """The kit's GGUF (8-bit attention, 4-bit MLP), in float32 and in the default dtype (bf16 on AVX2 CPUs)."""
    llm = LLM(str(pocketllm_kit_checkpoint("llama-gguf")), backend="torch", dtype=dtype)
    try:
        assert_alone_equals_busy(llm, PROMPT)
    finally:
        llm.shutdown()


@requires_default_model
def test_default_model_request_has_the_same_logprobs_alone_and_in_a_busy_batch() -> None:
    """The default model (Q4_1) as the default server runs it."""
    llm = LLM("smollm2-135m-instruct", backend="torch")
    try:
        assert_alone_equals_busy(llm, PROMPT)
    finally:
        llm.shutdown()
