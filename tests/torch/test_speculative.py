"""Speculative decoding on the torch backend: rejected drafts leave no trace (KV or Gated DeltaNet state), sampled
outputs keep the target's distribution (and a wrong acceptance rule is caught), drafting pauses where it does not
pay, and stops above its batch size."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from pocketllm import LLM, SamplingParams
from pocketllm.ngram_proposer import NgramProposer
from pocketllm.testing.checkpoints import cycle_order
from pocketllm.testing.protocol import LONG_PROMPT, PROMPTS

pytest.importorskip("pocketllm_torch")

NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 4}
MTP = {"speculative_method": "mtp", "num_speculative_tokens": 4}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SAMPLES = 2000
P_VALUE = 1e-3
HEAD_SCALE = 0.08


def make(path: Path, **kwargs: object) -> LLM:
    return LLM(str(path), backend="torch", dtype="float32", **kwargs)


@pytest.fixture(scope="module", params=["llama-cyclic", "qwen3_5-cyclic"])
def cyclic(request: pytest.FixtureRequest, pocketllm_kit_checkpoint) -> Path:
    return pocketllm_kit_checkpoint(request.param)


@pytest.fixture(scope="module")
def llama_cyclic(pocketllm_kit_checkpoint) -> Path:
    return pocketllm_kit_checkpoint("llama-cyclic")


@pytest.fixture(scope="module", params=[("llama-cyclic", NGRAM), ("qwen3_5-cyclic-mtp", MTP)],
                ids=["ngram", "mtp"])
def soft_cyclic(request: pytest.FixtureRequest, pocketllm_kit_checkpoint,
                tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, object]]:
    """A cyclic model with its head scaled down (greedy outputs unchanged: every logit scales alike), so that at
    temperature 1 the cycle's next token has a probability well inside (0, 1), not ~1; and the method that drafts
    for it (an MTP head shares the scaled head)."""
    from safetensors.numpy import load_file, save_file

    name, method = request.param
    path = tmp_path_factory.mktemp("soft-cyclic")
    for item in pocketllm_kit_checkpoint(name).iterdir():
        shutil.copy(item, path / item.name)
    weights = load_file(str(path / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * np.float32(HEAD_SCALE)
    save_file(weights, str(path / "model.safetensors"))
    return path, method


@pytest.fixture
def plain_and_spec(cyclic: Path) -> Iterator[tuple[LLM, LLM]]:
    plain, spec = make(cyclic), make(cyclic, **NGRAM)
    yield plain, spec
    plain.shutdown()
    spec.shutdown()


def tokens(llm: LLM, prompt: str | list[int], params: SamplingParams = GREEDY) -> list[int]:
    return llm.generate(prompt, params)[0].outputs[0].token_ids


def test_drafts_that_are_all_rejected_change_nothing(plain_and_spec: tuple[LLM, LLM],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every draft a token the model never says next: each verification writes KV (and, in the hybrid, Gated
    DeltaNet states) for rows that are all rejected, and the output is still that of plain decoding."""
    plain, spec = plain_and_spec
    expected = {prompt: tokens(plain, prompt) for prompt in [*PROMPTS, LONG_PROMPT]}
    never = next(t for t in range(1, 300) if all(t not in out for out in expected.values()))
    monkeypatch.setattr(NgramProposer, "propose", lambda self, ids, k: [never] * k)
    assert {prompt: tokens(spec, prompt) for prompt in expected} == expected
    stats = spec.stats()
    assert stats.num_spec_draft_tokens > 0 and stats.num_spec_accepted_tokens == 0


def test_sampled_and_greedy_outputs_and_logprobs_are_those_without_drafts(plain_and_spec: tuple[LLM, LLM]) -> None:
    """Each row draws from noise seeded by the request's seed and the token's index, so a seeded request gives the
    very tokens it gives without speculation; logprobs are the target's, row by row."""
    plain, spec = plain_and_spec
    for params in (SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True),
                   SamplingParams(temperature=0.7, top_k=20, seed=-3, max_tokens=40, ignore_eos=True,
                                  repetition_penalty=1.2, presence_penalty=0.5, min_tokens=30)):
        for prompt in [*PROMPTS, LONG_PROMPT]:
            assert tokens(spec, prompt, params) == tokens(plain, prompt, params)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, logprobs=3)
    [a], [b] = plain.generate(LONG_PROMPT, params), spec.generate(LONG_PROMPT, params)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
        assert x.rank == y.rank and [t.token_id for t in x.top] == [t.token_id for t in y.top]
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
    assert spec.stats().num_spec_accepted_tokens > 0


def first_two_tokens(llm: LLM, prompt: list[int], seeds: range) -> Counter[tuple[int, int]]:
    """(A third token leaves room for a draft of the second: drafts never reach past max_tokens.)"""
    params = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True, seed=s) for s in seeds]
    outs = llm.generate([prompt] * len(params), params)
    return Counter((out.outputs[0].token_ids[0], out.outputs[0].token_ids[1]) for out in outs)


def homogeneity_p_value(a: Counter[tuple[int, int]], b: Counter[tuple[int, int]]) -> float:
    """Pearson's chi-square test that two samples come from one distribution; outcomes seen fewer than 10 times
    in both together are pooled into one cell, so that every expected count is large enough for the test."""
    both = a + b
    common = [o for o, count in both.items() if count >= 10]
    rest = [o for o in both if o not in common]
    cells = [(a[o], b[o]) for o in common] + ([(sum(a[o] for o in rest), sum(b[o] for o in rest))] if rest else [])
    total_a, total_b = sum(a.values()), sum(b.values())
    statistic = 0.0
    for count_a, count_b in cells:
        expected = count_a + count_b
        for observed, total in ((count_a, total_a), (count_b, total_b)):
            e = expected * total / (total_a + total_b)
            statistic += (observed - e) ** 2 / e
    df = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def test_speculation_keeps_the_distribution_and_a_wrong_rule_does_not(soft_cyclic: tuple[Path, dict[str, object]],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """2,000 draws of the first two tokens at temperature 1, top-p 0.9, with and without drafts (different seeds:
    independent samples). The prompt is every cycle once, so the second token is drafted (from the prompt, or by
    the MTP head, which predicts the cycle) and the draft is often, not always, what the model samples. Accepting
    every draft is caught."""
    path, method = soft_cyclic
    plain = make(path, max_num_seqs=64, enable_prefix_caching=True)
    spec = make(path, max_num_seqs=64, enable_prefix_caching=True, speculative_disable_by_batch_size=64, **method)
    try:
        prompt = cycle_order(plain.tokenizer.vocab_size).tolist()  # every cycle once: each token is drafted
        without = first_two_tokens(plain, prompt, range(SAMPLES))
        with_drafts = first_two_tokens(spec, prompt, range(SAMPLES, 2 * SAMPLES))
        stats = spec.stats()
        assert stats.num_spec_drafts >= SAMPLES // 2
        assert 0.2 * stats.num_spec_drafts < stats.num_spec_accepted_tokens < 0.95 * stats.num_spec_drafts
        same = homogeneity_p_value(without, with_drafts)
        print(f"accepted {stats.num_spec_accepted_tokens} of {stats.num_spec_drafts} drafts; p = {same:.3g}")
        assert same > P_VALUE
        monkeypatch.setattr("pocketllm_torch.engine.accepts", lambda sampled, drafted: True)
        always = first_two_tokens(spec, prompt, range(2 * SAMPLES, 3 * SAMPLES))
        wrong = homogeneity_p_value(without, always)
        print(f"accepting every draft: p = {wrong:.3g}")
        assert wrong < P_VALUE
    finally:
        plain.shutdown()
        spec.shutdown()


def test_drafts_that_keep_missing_pause_drafting(pocketllm_tiny_llama: Path) -> None:
    """The kit's plain Llama never repeats itself: its drafts (single tokens that occurred before) are almost all
    rejected, and the pauses keep the verifications to a small share of its steps."""
    spec = make(pocketllm_tiny_llama, **NGRAM)
    try:
        out = tokens(spec, LONG_PROMPT, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        stats = spec.stats()
        assert len(out) == 200
        assert stats.num_spec_accepted_tokens < stats.num_spec_draft_tokens / 4
        assert 0 < stats.num_spec_drafts < 40
    finally:
        spec.shutdown()


def test_no_drafts_above_the_batch_size(llama_cyclic: Path) -> None:
    spec = make(llama_cyclic, speculative_disable_by_batch_size=2, **NGRAM)
    try:
        spec.generate(PROMPTS[:3], GREEDY)  # three at once: nobody drafts
        assert spec.stats().num_spec_drafts == 0
        spec.generate(PROMPTS[0], GREEDY)
        assert spec.stats().num_spec_drafts > 0
    finally:
        spec.shutdown()


def test_a_hybrid_s_verifications_keep_states_within_their_budget(pocketllm_kit_checkpoint,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Each verified row of a hybrid model keeps a copy of its state: a step keeps at most VERIFY_STATE_BYTES of
    them (here room for two rows), and drafts past that wait, without changing the output."""
    from pocketllm_torch import model_runner

    path = pocketllm_kit_checkpoint("qwen3_5-cyclic")
    plain = make(path)
    expected = tokens(plain, LONG_PROMPT)
    plain.shutdown()
    spec = make(path, **NGRAM)
    states = spec.backend_engine.runner.state_cache
    row_bytes = states.conv[:, 0].numel() * states.conv.element_size() + states.recurrent[:, 0].numel() * 4
    spec.shutdown()
    monkeypatch.setattr(model_runner, "VERIFY_STATE_BYTES", 2 * row_bytes)
    spec = make(path, **NGRAM)
    try:
        events = list(spec.generate_stream(LONG_PROMPT, GREEDY))
        assert [t for e in events for t in e.token_ids] == expected
        assert 1 < max(len(e.token_ids) for e in events) <= 3  # the last token's row and at most two drafts' rows
    finally:
        spec.shutdown()
