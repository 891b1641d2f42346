"""The state layers' per-request states, one slot per running request, and the free list of slots.

A Gated DeltaNet layer keeps the last (kernel - 1) inputs of its causal convolution and a float32 recurrent
state, whatever the request's length. Every state layer's slot s belongs to the same request. torch.empty leaves
untouched slots unpaged; a slot is zeroed when a request starts from its first token (see ModelRunner).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from pocketllm_torch.cache_spec import StateSpec


@dataclass(slots=True)
class LayerState:
    conv: Tensor  # [slots, channels, kernel - 1], in the activations' dtype
    recurrent: Tensor  # [slots, value heads, key dim, value dim], float32


class StateCache:
    def __init__(self, num_layers: int, num_slots: int, spec: StateSpec, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.conv = torch.empty(num_layers, num_slots, *spec.conv_shape, dtype=dtype, device=device)
        self.recurrent = torch.empty(num_layers, num_slots, *spec.recurrent_shape, dtype=torch.float32, device=device)
        self.layers = [LayerState(c, r) for c, r in zip(self.conv.unbind(0), self.recurrent.unbind(0), strict=True)]

    @staticmethod
    def bytes_per_slot(num_layers: int, spec: StateSpec, dtype: torch.dtype) -> int:
        conv, recurrent = spec.conv_shape, spec.recurrent_shape
        return num_layers * (conv[0] * conv[1] * dtype.itemsize + recurrent[0] * recurrent[1] * recurrent[2] * 4)

    def reset(self, slots: Tensor) -> None:
        """Zero these slots: their requests start from their first token."""
        self.conv.index_fill_(1, slots, 0)
        self.recurrent.index_fill_(1, slots, 0)


class StateSlots:
    """Hands out state slots: one per running request, at most ``num_slots`` (max_num_seqs) at once."""

    def __init__(self, num_slots: int) -> None:
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.num_slots = num_slots

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free_slots)

    def allocate(self) -> int:
        # The scheduler runs at most max_num_seqs requests, the number of slots: one is always free here.
        return self.free_slots.pop()

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)
