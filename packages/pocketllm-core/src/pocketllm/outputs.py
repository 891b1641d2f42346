"""Backend-neutral results: what ``LLM`` returns and what streams yield."""

from __future__ import annotations

import msgspec

from pocketllm.backend import SampledLogprobs


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int | None = None
    """With ``SamplingParams.reasoning``: the completion tokens of the choices' reasoning sections."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class CompletionOutput(msgspec.Struct, kw_only=True):
    """One of the ``n`` choices of a request.

    ``finish_reason`` is ``"stop"``, ``"length"`` or ``"abort"`` (None while
    running). ``stop_reason`` is the stop string or stop token id that matched,
    None for EOS or other reasons.
    """

    index: int
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[SampledLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    reasoning: str | None = None
    """With ``SamplingParams.reasoning``: the text of the reasoning section, without its tags (None when the
    reply has no section)."""
    answer: str | None = None
    """With ``SamplingParams.reasoning``: the text after the section (all of ``text`` when there is none)."""
    reasoning_tokens: int | None = None
    """With ``SamplingParams.reasoning``: how many of ``token_ids`` belong to the section."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct, kw_only=True):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    usage: Usage
    prompt_logprobs: list[SampledLogprobs | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: one entry per prompt token, None for the first (nothing comes
    before it), each the token's logprob given the tokens before it and its top alternatives."""

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)


class StreamEvent(msgspec.Struct, kw_only=True):
    """New text and tokens for one choice, from one engine step (one token or several). The last event of a
    choice has ``finish_reason`` set.

    With ``SamplingParams.reasoning`` the core splits the reply once, here: ``reasoning`` and ``answer`` are this
    event's share of the section and of the answer after it (``text`` holds both, with the tags); both are None
    without it. The reasoning section ends at its closing tag, and the blank lines after it belong to neither.
    """

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[SampledLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    reasoning: str | None = None
    answer: str | None = None
    reasoning_tokens: int | None = None
    """On a choice's last event, with ``SamplingParams.reasoning``: its tokens in the section."""
    usage: Usage | None = None
    """Set on the final event of the whole request (after every choice finished)."""
    prompt_logprobs: list[SampledLogprobs | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: the prompt's logprobs (as ``RequestOutput.prompt_logprobs``), on
    each choice's first event."""
