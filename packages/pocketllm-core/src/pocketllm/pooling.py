"""Embeddings: how a prompt's final hidden states become one vector, and what the caller gets back."""

from __future__ import annotations

import msgspec

from pocketllm.errors import ConfigError

POOLING_TYPES = ("last", "mean", "cls")
"""``last``: the last prompt token's state (what a causal model has seen the whole prompt by); ``mean``: the
average over every prompt token; ``cls``: the first token's (checkpoints trained that way say so)."""

DEFAULT_POOLING_TYPE = "last"  # vLLM's for a decoder model without a pooling config


class PoolingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to pool one prompt into an embedding.

    ``pooling_type`` None takes the checkpoint's pooling config (sentence-transformers' ``1_Pooling``, GGUF's
    ``{arch}.pooling_type``), else :data:`DEFAULT_POOLING_TYPE`. ``dimensions`` is OpenAI's: only the model's
    hidden size is accepted, since no supported model is trained for shortened (Matryoshka) vectors.
    """

    pooling_type: str | None = None
    normalize: bool = True
    """L2-normalize the vector (as vLLM and sentence-transformers do for embedding models)."""
    dimensions: int | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ConfigError("pooling_type", f"must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ConfigError("normalize", f"must be true or false, got {self.normalize!r}")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or isinstance(self.dimensions, bool)
                                            or self.dimensions < 1):
            raise ConfigError("dimensions", f"must be a positive integer, got {self.dimensions!r}")


class EmbeddingOutput(msgspec.Struct, kw_only=True):
    request_id: str
    embedding: list[float]
    prompt_token_ids: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
