"""Engine logprobs (token ids) in the two OpenAI shapes: chat's ``content[]`` and completions' parallel lists."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pocketllm import SampledLogprobs
from pocketllm_server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

if TYPE_CHECKING:
    from pocketllm.tokenizer import Tokenizer


class TokenTexts:
    """The text of single token ids, cached: the same ids recur across steps and top-k lists."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def bytes_of(self, token_id: int) -> list[int]:
        """The token's raw bytes: a multi-byte character split across tokens is whole once they are joined."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = list(self.tokenizer.token_bytes(token_id))
        return raw

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            # Special tokens are kept: a logprob for "<|im_end|>" should say so, not be an empty string.
            text = self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text


def chat_logprobs(entries: list[SampledLogprobs], text_of: TokenTexts) -> ChatLogprobs:
    def top(token_id: int, logprob: float) -> TopLogprob:
        return TopLogprob(token=text_of(token_id), logprob=logprob, bytes=text_of.bytes_of(token_id))

    content = []
    for entry in entries:
        token = text_of(entry.token_id)
        content.append(ChatTokenLogprob(token=token, logprob=entry.logprob, bytes=text_of.bytes_of(entry.token_id),
                                        top_logprobs=[top(t.token_id, t.logprob) for t in entry.top]))
    return ChatLogprobs(content=content)


def completion_logprobs(entries: list[SampledLogprobs], text_of: TokenTexts, offset: int) -> CompletionLogprobs:
    """``offset`` is where the first token's text starts in the choice's text (earlier chunks, echoed prompt)."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for entry in entries:
        token = text_of(entry.token_id)
        result.tokens.append(token)
        result.token_logprobs.append(entry.logprob)
        # OpenAI's dict holds the sampled token as well as the alternatives.
        top = {text_of(t.token_id): t.logprob for t in entry.top}
        top.setdefault(token, entry.logprob)
        result.top_logprobs.append(top)
        result.text_offset.append(offset)
        offset += len(token)
    return result
