"""Prefix caching for state layers: copies of a request's Gated DeltaNet states at block boundaries.

A cached prefix of a hybrid model needs the attention layers' KV blocks (hash-chained in the block manager) and
every state layer's (conv, recurrent) state at the prefix's end. The state is a running summary, so it can only
be copied where a forward pass has it: at the end of a prompt chunk (the scheduler ends chunks at block
boundaries and at the prompt's last full-block boundary) and, inside a chunk, after every 64 tokens of the
chunked delta rule that fall on a block boundary. The runner files each under the hash of the prefix that ends
there. A new request resumes from the deepest boundary where both are cached.
Snapshots are evicted least recently used under a byte budget.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from pocketllm_torch.state_cache import StateCache


class StateSnapshots:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # snapshots that fit the budget
        self.entries: OrderedDict[int, tuple[Tensor, Tensor]] = OrderedDict()
        self.num_hits = 0
        self.num_evictions = 0

    def __contains__(self, key: int) -> bool:
        return key in self.entries

    def save(self, key: int, conv: Tensor, recurrent: Tensor) -> None:
        """Copy every state layer's (conv, recurrent) state, stacked by layer, under the prefix hash ``key``."""
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        while len(self.entries) >= self.capacity:
            self.entries.popitem(last=False)
            self.num_evictions += 1
        self.entries[key] = conv.clone(), recurrent.clone()

    def restore(self, key: int, cache: StateCache, slot: int) -> None:
        conv, recurrent = self.entries[key]
        self.entries.move_to_end(key)
        cache.conv[:, slot] = conv
        cache.recurrent[:, slot] = recurrent
        self.num_hits += 1
