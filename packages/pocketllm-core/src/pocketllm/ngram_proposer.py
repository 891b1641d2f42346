"""Prompt lookup (``speculative_method="ngram"``): drafts copied from a sequence's own earlier tokens.

The draft is the continuation of the latest earlier occurrence of the sequence's last ``ngram_max`` tokens, else
of its last ``ngram_max - 1``, down to ``ngram_min`` (vLLM's and llama.cpp's prompt lookup). A proposal is one
vectorised pass over the sequence (the places its last token occurred before), then at most ``ngram_max - 1``
passes over those places only: no tables, so its memory is the sequence's own ids (n-gram tables would hold up to
``ngram_max`` entries per token). Backends share it: it holds no tensors and knows nothing of a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from collections.abc import Sequence


class NgramProposer:
    """One sequence's ids, mirrored as it grows (appended to only); ``propose`` drafts from them."""

    __slots__ = ("_ids", "_len", "ngram_max", "ngram_min")

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._ids = np.empty(256, dtype=np.int64)
        self._len = 0

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of ``tokens``
        (``ngram_min`` .. ``ngram_max`` long) that occurred before; none where none did."""
        ids = self._mirror(tokens)
        end = len(ids)
        if k <= 0 or end <= self.ngram_min:
            return []
        # Candidates: where an earlier occurrence of the suffix would end (inclusive), with a token after it.
        ends = np.flatnonzero(ids[:end - 1] == ids[end - 1])
        length = 1
        while length < min(self.ngram_max, end - 1) and ends.size:
            longer = ends[(ends >= length) & (ids[np.maximum(ends - length, 0)] == ids[end - 1 - length])]
            if longer.size == 0:
                break
            ends, length = longer, length + 1
        if length < self.ngram_min or ends.size == 0:
            return []
        start = int(ends[-1]) + 1  # the latest of the longest
        return ids[start:start + k].tolist()

    def _mirror(self, tokens: Sequence[int]) -> np.ndarray:
        """The sequence's ids as an array, copying only the tokens appended since the last call."""
        n = len(tokens)
        if n > len(self._ids):
            grown = np.empty(max(n, 2 * len(self._ids)), dtype=np.int64)
            grown[:self._len] = self._ids[:self._len]
            self._ids = grown
        if n > self._len:
            self._ids[self._len:n] = tokens[self._len:n]
            self._len = n
        return self._ids[:n]
