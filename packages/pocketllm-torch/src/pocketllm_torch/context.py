"""What one forward pass needs beyond its token ids, built once per step by the model runner and passed down
through every layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from pocketllm_torch.attention import AttentionMetadata
    from pocketllm_torch.state_cache import LayerState


@dataclass(slots=True)
class StepContext:
    positions: Tensor  # [T]: position of each token in its sequence
    attention: AttentionMetadata  # block tables, slots and masks of the attention layers
    caches: list[Tensor | LayerState]  # per layer: its KV cache [2, kv heads, slots, head dim] or its states
    # Per sequence, in batch order: how many of its tokens run (the prefill / decode split: a decode step runs
    # one token of each) and its slot in the state layers' pools (None for a model without state layers).
    query_lens: list[int]
    state_slots: Tensor | None
    # Prefix-cache snapshots inside prompt chunks: per sequence, after how many of its tokens this step the state
    # layers keep their states (None: nowhere), and what they kept there, (conv, recurrent) in layer order.
    capture_points: list[list[int]] | None = None
    captured: dict[tuple[int, int], list[tuple[Tensor, Tensor]]] = field(default_factory=dict)
    # Speculative verifications: the sequences whose rows are a token and its drafts, and the (conv, recurrent)
    # states, in layer order, after p of their rows (p < their rows; the slot holds the state after all of them).
    verifying: frozenset[int] = frozenset()
    kept: dict[tuple[int, int], list[tuple[Tensor, Tensor]]] = field(default_factory=dict)

    @property
    def is_decode(self) -> bool:
        return self.attention.query_index is None
