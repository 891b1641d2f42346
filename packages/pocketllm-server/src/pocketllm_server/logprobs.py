"""Engine logprobs (token ids) in the two OpenAI shapes: chat's ``content[]`` and completions' parallel lists."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pocketllm import SampledLogprobs
from pocketllm_server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob, TopLogprob

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


def echoed_logprobs(prompt_ids: list[int], entries: list[SampledLogprobs | None], text_of: TokenTexts,
                    k: int) -> CompletionLogprobs:
    """The prompt's tokens as ``echo`` with ``logprobs`` shows them (OpenAI's legacy API, vLLM): the first token
    has no logprob; each other one its own and its ``k`` best alternatives, offsets counted from the echo's start."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    offset = 0
    for token_id, entry in zip(prompt_ids, entries, strict=True):
        token = text_of(token_id)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        if entry is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(entry.logprob)
        top = {text_of(t.token_id): t.logprob for t in entry.top[:k]}
        top.setdefault(token, entry.logprob)
        result.top_logprobs.append(top)
    return result


def vllm_prompt_logprobs(entries: list[SampledLogprobs | None], text_of: TokenTexts,
                         k: int) -> list[dict[str, PromptLogprob] | None]:
    """vLLM's ``prompt_logprobs``: per position, token id -> logprob, rank and text, the prompt's token first, then
    its ``k`` best alternatives."""
    out: list[dict[str, PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranks = {t.token_id: rank for rank, t in enumerate(entry.top, start=1)}
        position = {str(entry.token_id): PromptLogprob(logprob=entry.logprob, rank=entry.rank,
                                                       decoded_token=text_of(entry.token_id))}
        for t in entry.top[:k]:
            position.setdefault(str(t.token_id), PromptLogprob(logprob=t.logprob, rank=ranks[t.token_id],
                                                               decoded_token=text_of(t.token_id)))
        out.append(position)
    return out


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
