"""What one forward pass needs beyond its token ids, built once per step by the model runner and passed down
through every layer."""

from __future__ import annotations

from dataclasses import dataclass
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

    @property
    def is_decode(self) -> bool:
        return self.attention.query_index is None
