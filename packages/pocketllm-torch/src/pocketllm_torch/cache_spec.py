"""What each layer of a model keeps per request, for the engine to size and hand out."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AttentionSpec:
    """Keys and values of every position, in the paged KV cache's blocks."""

    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True, slots=True)
class StateSpec:
    """A fixed-size state whatever the request's length, in one slot per running request (Gated DeltaNet: the
    last inputs of its causal convolution, and its recurrent state, kept in float32)."""

    conv_shape: tuple[int, int]  # (channels, kernel size - 1)
    recurrent_shape: tuple[int, int, int]  # (value heads, key head size, value head size)


LayerCacheSpec = AttentionSpec | StateSpec
