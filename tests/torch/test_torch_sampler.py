"""Sampler on hand-made logits: each processing step, seeded reproducibility, and logprobs."""

from __future__ import annotations

import pytest
import torch

from pocketllm.sampling_params import SamplingParams
from pocketllm_torch.sampler import apply_penalties, process_logits, sample
from pocketllm_torch.sequence import Sequence

VOCAB = 50


def make_seq(params: SamplingParams, prompt: tuple[int, ...] = (1, 2, 3), output: tuple[int, ...] = (),
             stop: frozenset[int] = frozenset({0})) -> Sequence:
    seed = None if params.is_greedy else params.seed or 0
    return Sequence("r", [*prompt, *output], len(prompt), params, 100, stop, seed)


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_is_argmax(logits: torch.Tensor) -> None:
    tokens, logprobs = sample(logits, [make_seq(SamplingParams(temperature=0.0)) for _ in range(4)])
    assert tokens == logits.argmax(-1).tolist() and logprobs == [None] * 4


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.5, top_k=1, seed=1),
    SamplingParams(temperature=1.5, top_p=1e-6, seed=2),
    SamplingParams(temperature=1.5, top_p=1e-300, seed=2),  # 0 in float32: the top token still stays
    SamplingParams(temperature=1e-4, seed=4),
    SamplingParams(temperature=1.5, min_p=1.0, seed=3),
])
def test_truncation_to_one_token_is_greedy(logits: torch.Tensor, params: SamplingParams) -> None:
    for _ in range(5):
        assert sample(logits, [make_seq(params) for _ in range(4)])[0] == logits.argmax(-1).tolist()


def test_top_k_and_min_p_bound_the_choices() -> None:
    row = torch.tensor([[4.0, 3.9, 3.8, 0.0, -1.0, 2.0]])
    probs = row.softmax(-1)[0]
    allowed_min_p = {i for i in range(6) if probs[i] >= 0.5 * probs.max()}
    seen_top_k, seen_min_p = set(), set()
    for seed in range(60):
        seen_top_k |= set(sample(row, [make_seq(SamplingParams(top_k=2, seed=seed))])[0])
        seen_min_p |= set(sample(row, [make_seq(SamplingParams(min_p=0.5, seed=seed))])[0])
    assert seen_top_k == {0, 1}
    assert seen_min_p == allowed_min_p == {0, 1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    row = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen = set()
    for seed in range(80):
        seen |= set(sample(row, [make_seq(SamplingParams(top_p=0.7, seed=seed))])[0])
    assert seen == {0, 1}


def test_logit_bias_forces_a_token(logits: torch.Tensor) -> None:
    params = SamplingParams(temperature=0.0, logit_bias={7: 100.0})
    assert sample(logits, [make_seq(params) for _ in range(4)])[0] == [7] * 4


def test_min_tokens_masks_stop_tokens_until_reached() -> None:
    row = torch.zeros(1, VOCAB)
    row[0, 0] = 10.0  # EOS
    row[0, 5] = 9.0  # an explicit stop token
    row[0, 7] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[5])
    assert sample(row, [make_seq(params, output=(9,), stop=frozenset({0, 5}))])[0] == [7]
    assert sample(row, [make_seq(params, output=(9, 9), stop=frozenset({0, 5}))])[0] == [0]


def test_penalties_follow_vllm() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    out = apply_penalties(logits, [[0]], [[1, 1, 2]], repetition=[2.0], frequency=[0.5], presence=[0.25])
    # token 0: prompt only -> repetition: 2 / 2; token 1: output twice -> -1 * 2 - 0.5 * 2 - 0.25;
    # token 2: output once -> 0.5 / 2 - 0.5 - 0.25; token 3: unseen.
    assert out.tolist() == [[1.0, -3.25, -0.5, 1.0]]


def test_process_logits_leaves_the_raw_logits_alone(logits: torch.Tensor) -> None:
    raw = logits.clone()
    params = SamplingParams(repetition_penalty=1.5, logit_bias={3: 5.0}, min_tokens=4, seed=0)
    processed = process_logits(logits, [make_seq(params) for _ in range(4)])
    assert torch.equal(logits, raw) and not torch.equal(processed, raw)
    assert processed[:, 0].eq(float("-inf")).all()


def test_same_seed_same_tokens_whatever_the_batch(logits: torch.Tensor) -> None:
    def draw(batch_seeds: list[int], steps: int = 8) -> list[list[int]]:
        """Each step's tokens, appended to their sequences as the engine does: a draw's noise is seeded by the
        request's seed and the index of the token it draws."""
        seqs = [make_seq(SamplingParams(temperature=1.0, seed=s)) for s in batch_seeds]
        out = []
        for _ in range(steps):
            tokens = sample(logits[0].expand(len(seqs), VOCAB), seqs)[0]
            for seq, token in zip(seqs, tokens, strict=True):
                seq.token_ids.append(token)
            out.append(tokens)
        return out

    alone = [step[0] for step in draw([42])]
    batched = [step[1] for step in draw([7, 42, 9])]
    assert alone == batched == [step[0] for step in draw([42])]
    assert len(set(alone)) > 1  # it does sample
    assert alone != [step[0] for step in draw([43])]


def test_logprobs_are_log_softmax_of_raw_logits(logits: torch.Tensor) -> None:
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={5: 50.0}), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.7, logprobs=5, seed=1)]
    tokens, logprobs = sample(logits, [make_seq(p) for p in params])
    reference = logits.log_softmax(-1)
    assert tokens[0] == 5 and logprobs[1] is None
    for row, k in ((0, 3), (2, 0), (3, 5)):
        lp = logprobs[row]
        assert lp is not None and lp.token_id == tokens[row] and len(lp.top) == k
        assert lp.logprob == pytest.approx(reference[row, tokens[row]].item(), abs=1e-6)
        assert lp.rank == int((reference[row] > reference[row, tokens[row]]).sum()) + 1
        top_values, top_ids = reference[row].topk(k)
        assert [t.token_id for t in lp.top] == top_ids.tolist()
        assert [t.logprob for t in lp.top] == pytest.approx(top_values.tolist(), abs=1e-6)
    assert logprobs[0].rank > 1  # chosen by the bias, not by the raw logits
