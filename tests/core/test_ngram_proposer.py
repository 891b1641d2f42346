"""The core's prompt-lookup drafter: the latest of the longest earlier occurrences of a sequence's suffix, within
ngram_min..ngram_max, its continuation cut to k and to the sequence's end (the cpp engine's ngram_draft has the
same cases in packages/pocketllm-cpp/tests/cpp_test.cpp)."""

from __future__ import annotations

import numpy as np
import pytest

from pocketllm.ngram_proposer import NgramProposer


@pytest.mark.parametrize(("tokens", "ngram", "k", "draft"), [
    ([1, 2, 3, 4, 5, 9, 1, 2, 3], (1, 4), 3, [4, 5, 9]),
    ([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 2, 3], (1, 4), 3, [7, 8, 2]),
    ([1, 2, 3, 1, 2], (3, 4), 2, []),
    ([1, 2, 3, 1, 2], (2, 4), 2, [3, 1]),
    ([5, 5, 5, 5], (1, 4), 3, [5]),
    ([7, 1, 2, 8, 2, 9, 1, 2], (1, 4), 2, [8, 2]),  # "1 2" beats the later "2"
    ([1, 2, 3], (1, 4), 0, []),
    ([4], (1, 1), 2, []),
])
def test_drafts_continue_the_latest_longest_match(tokens: list[int], ngram: tuple[int, int], k: int,
                                                   draft: list[int]) -> None:
    assert NgramProposer(*ngram).propose(tokens, k) == draft


def brute_force(tokens: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    for n in range(min(ngram_max, len(tokens) - 1), ngram_min - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # latest first; an occurrence needs a token after it
            if tokens[end - n:end] == suffix:
                return tokens[end:end + k]
    return []


def test_a_growing_sequence_drafts_as_a_brute_force_search_does() -> None:
    rng = np.random.default_rng(0)
    proposer = NgramProposer(2, 5)
    tokens: list[int] = []
    for _ in range(400):
        tokens.append(int(rng.integers(0, 6)))
        assert proposer.propose(tokens, 4) == brute_force(tokens, 2, 5, 4), tokens


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="ngram_min"):
        NgramProposer(3, 2)
