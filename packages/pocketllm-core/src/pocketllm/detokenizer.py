"""Incremental detokenization and stop-string matching for one choice."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pocketllm.tokenizer import Tokenizer

# Decoding a few tokens before the new ones keeps tokenizers that merge
# spaces into word pieces (SentencePiece) from dropping or adding spaces.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns token ids into text deltas without ever emitting half a UTF-8 character.

    Text of the tokens since ``prefix_offset`` is decoded twice: up to the last
    emitted token and up to the newest. Their difference is new text, held back
    while it ends in U+FFFD (an incomplete multi-byte sequence).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """Text still held back at the end of generation (it may contain U+FFFD)."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""


class StopMatcher:
    """Finds the earliest stop string in growing text and says how much is safe to stream."""

    def __init__(self, stops: list[str], include_stop: bool) -> None:
        self.stops = stops
        self.include_stop = include_stop
        self.holdback = max((len(s) for s in stops), default=1) - 1

    def find(self, text: str, num_new_chars: int) -> tuple[int, str] | None:
        """Return ``(cut, stop)`` for a stop string touching the last ``num_new_chars``, else None.

        ``cut`` is where the output ends: before the stop string, or after it when included.
        """
        start = max(0, len(text) - num_new_chars - self.holdback)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            pos = text.find(stop, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        return (pos + len(stop) if self.include_stop else pos), stop

    def safe_length(self, text: str) -> int:
        """How much of ``text`` can be streamed without emitting the start of a stop string."""
        return len(text) - self.holdback if self.stops else len(text)
