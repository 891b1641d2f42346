"""Per-request sampling parameters, validated with vLLM's semantics."""

from __future__ import annotations

import math

import msgspec

from pocketllm.errors import ConfigError
from pocketllm.limits import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_N,
    MAX_REPETITION_PENALTY,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MIN_REPETITION_PENALTY,
)
from pocketllm.reasoning import REASONING_PARSERS
from pocketllm.structured import StructuredOutputs

_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request. ``temperature == 0`` means greedy.

    Penalties follow vLLM: presence/frequency apply to generated tokens,
    repetition applies to prompt and generated tokens (divide positive logits,
    multiply negative ones).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 disables
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives; 0 = chosen token only
    prompt_logprobs: int | None = None
    """The prompt's tokens' logprobs (each given the tokens before it; the first has none), with this many top
    alternatives, from the raw model logits: ``RequestOutput.prompt_logprobs``. With ``max_tokens=0`` the request
    only scores its prompt."""
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None  # what the output must match (a grammar constrains it)
    reasoning: str | None = None
    """The output opens with a reasoning section in this format (:data:`pocketllm.reasoning.REASONING_PARSERS`):
    ``structured_outputs`` constrain only what follows it, ``stop`` strings inside it do not end the request
    unless ``stop_in_reasoning``, and the output comes split: ``reasoning``, ``answer`` and ``reasoning_tokens``
    of each CompletionOutput and StreamEvent, and ``Usage.reasoning_tokens``."""
    stop_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # Types first: a request built in Python (or decoded loosely) must not reach a comparison or a kernel
        # with a string, a bool, NaN or an integer no native type holds.
        for name in ("n", "min_tokens", "top_k"):
            _check(_is_int(getattr(self, name)), name, f"must be an integer, got {getattr(self, name)!r}")
        for name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or _is_int(value), name, f"must be an integer or None, got {value!r}")
        for name in _FLOATS:
            value = getattr(self, name)
            _check(_is_real(value) and math.isfinite(value), name, f"must be a finite number, got {value!r}")
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "stop_in_reasoning"):
            _check(isinstance(getattr(self, name), bool), name, f"must be true or false, got {getattr(self, name)!r}")
        _check(1 <= self.n <= MAX_N, "n", f"must be between 1 and {MAX_N}, got {self.n}")
        _check(self.max_tokens is None or 1 <= self.max_tokens <= INT64_MAX
               or (self.max_tokens == 0 and self.prompt_logprobs is not None), "max_tokens",
               f"must be at least 1 (0 only to score the prompt, with prompt_logprobs), got {self.max_tokens}")
        _check(0 <= self.min_tokens <= INT64_MAX, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        _check(self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or 0 <= self.top_k <= INT64_MAX, "top_k",
               f"must be -1, 0 or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY, "repetition_penalty",
               f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}], got {self.repetition_penalty}")
        _check(self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "seed", "must fit in a signed 64-bit integer")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or 0 <= value <= MAX_LOGPROBS, name,
                   f"must be between 0 and {MAX_LOGPROBS}, got {value}")
        _check(isinstance(self.stop, list) and len(self.stop) <= MAX_STOP_STRINGS, "stop",
               f"must be a string or a list of at most {MAX_STOP_STRINGS} strings")
        _check(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
               f"must be non-empty strings of at most {MAX_STOP_STRING_CHARS} characters")
        _check(isinstance(self.stop_token_ids, list) and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
               "stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
        _check(all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative token ids")
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputs),
               "structured_outputs", "must be a StructuredOutputs")
        _check(self.reasoning is None or self.reasoning in REASONING_PARSERS, "reasoning",
               f"must be one of {', '.join(REASONING_PARSERS)} or None, got {self.reasoning!r}")
        _check(isinstance(self.logit_bias, dict), "logit_bias", "must map token ids to numbers")
        _check(all(_is_int(t) and 0 <= t <= INT64_MAX for t in self.logit_bias), "logit_bias",
               "keys must be non-negative token ids")
        _check(all(_is_real(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in self.logit_bias.values()),
               "logit_bias", f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def effective_top_k(self) -> int:
        """Top-k with every 'disabled' spelling mapped to 0."""
        return 0 if self.top_k in (0, -1) else self.top_k


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(field, message)
