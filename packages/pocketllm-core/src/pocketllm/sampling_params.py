"""Per-request sampling parameters, validated with vLLM's semantics."""

from __future__ import annotations

import msgspec

from pocketllm.errors import ConfigError
from pocketllm.limits import INT64_MAX, INT64_MIN, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N


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
    logit_bias: dict[int, float] = msgspec.field(default_factory=dict)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(1 <= self.n <= MAX_N, "n", f"must be between 1 and {MAX_N}, got {self.n}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be non-negative, got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}")
        _check(self.temperature >= 0.0, "temperature", f"must be non-negative, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", f"must be -1, 0 or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(0.0 < self.repetition_penalty <= 2.0, "repetition_penalty",
               f"must be in (0, 2], got {self.repetition_penalty}")
        _check(self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "seed", "must fit in a signed 64-bit integer")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative token ids")
        _check(all(-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in self.logit_bias.values()), "logit_bias",
               f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        _check(all(t >= 0 for t in self.logit_bias), "logit_bias", "keys must be non-negative token ids")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def effective_top_k(self) -> int:
        """Top-k with every 'disabled' spelling mapped to 0."""
        return 0 if self.top_k in (0, -1) else self.top_k


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ConfigError(field, message)
