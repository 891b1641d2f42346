"""Prompt logprobs on the torch backend under the scored-rows bound: a step holds at most
``scored_rows_per_step`` rows of vocabulary logits (256 MiB of them by default), and a long prompt scored under a
small bound comes out the same, a chunk of scored rows a step."""

from __future__ import annotations

from pathlib import Path

import pytest

from pocketllm import LLM, SamplingParams

pytest.importorskip("pocketllm_torch")


def scores(path: Path, prompt: list[int]) -> list[float]:
    llm = LLM(str(path), backend="torch", dtype="float32")
    try:
        [out] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
        return [entry.logprob for entry in out.prompt_logprobs[1:]]
    finally:
        llm.shutdown()


def test_a_small_scored_rows_bound_scores_the_same(pocketllm_tiny_llama: Path, monkeypatch) -> None:
    import pocketllm_torch.model_runner as runner

    prompt = list(range(3, 60))
    unbounded = scores(pocketllm_tiny_llama, prompt)
    monkeypatch.setattr(runner, "SCORED_LOGITS_BYTES", 0)
    monkeypatch.setattr(runner, "MIN_SCORED_ROWS", 8)  # 7 steps of 8 rows for this prompt
    assert scores(pocketllm_tiny_llama, prompt) == pytest.approx(unbounded, abs=1e-5)
    assert len(unbounded) == len(prompt) - 1
