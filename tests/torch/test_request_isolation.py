"""What one request's parameters make fail in a step fails that request alone; the engine serves on."""

from __future__ import annotations

from pathlib import Path

import pytest

from pocketllm import LLM, RequestFailedError, SamplingParams
from pocketllm_torch import sampler

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
POISON_SEED = 666


def test_a_request_failing_in_sampling_fails_alone(pocketllm_tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    choose = sampler.choose_tokens

    def choose_or_fail(logits, seqs):
        if any(seq.params.seed == POISON_SEED for seq in seqs):
            raise FloatingPointError("a kernel fault this request's parameters trigger")
        return choose(logits, seqs)

    monkeypatch.setattr(sampler, "choose_tokens", choose_or_fail)
    llm = LLM(str(pocketllm_tiny_llama), backend="torch", dtype="float32")
    try:
        alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in ("one", "two")]
        first = llm.generate_stream("one", GREEDY)
        poisoned = llm.generate_stream("two", SamplingParams(temperature=1.0, seed=POISON_SEED, max_tokens=12))
        second = llm.generate_stream("two", GREEDY)
        with pytest.raises(RequestFailedError, match="FloatingPointError"):
            list(poisoned)
        assert [t for e in first for t in e.token_ids] == alone[0]
        assert [t for e in second for t in e.token_ids] == alone[1]
        assert llm.is_alive
        stats = llm.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)
        assert llm.generate("one", GREEDY)[0].outputs[0].token_ids == alone[0]
    finally:
        llm.shutdown()
