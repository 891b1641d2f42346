"""Prefix caching for state layers: copies of a request's Gated DeltaNet states at block boundaries.

A cached prefix of a hybrid model needs the attention layers' KV blocks (hash-chained in the block manager) and
every state layer's (conv, recurrent) state at the prefix's end. The state is a running summary, so it can only
be copied where a forward pass has it: at the end of a prompt chunk (the scheduler ends chunks at block
boundaries and at the prompt's last full-block boundary) and, inside a chunk, after every 64 tokens of the
chunked delta rule that fall on a block boundary. The runner files each under the hash of the prefix that ends
there. A new request resumes from the deepest boundary where both are cached.
Snapshots are kept under a byte budget as a segmented LRU, as the cpp backend's are: a new snapshot is on probation
until a request resumes from it, and eviction takes probation's least recently used first. So the one-off ends of
many prompts cannot flush the snapshot of a prefix they all share. Resumed snapshots fill at most three quarters of
the room; past that the oldest of them goes back on probation, as its newest.
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
        self.probation: OrderedDict[int, tuple[Tensor, Tensor]] = OrderedDict()  # first: least recently used
        self.resumed: OrderedDict[int, tuple[Tensor, Tensor]] = OrderedDict()
        self.num_hits = 0
        self.num_evictions = 0

    def __contains__(self, key: int) -> bool:
        return key in self.probation or key in self.resumed

    def __len__(self) -> int:
        return len(self.probation) + len(self.resumed)

    def save(self, key: int, conv: Tensor, recurrent: Tensor) -> None:
        """Copy every state layer's (conv, recurrent) state, stacked by layer, under the prefix hash ``key``."""
        for segment in (self.probation, self.resumed):
            if key in segment:
                segment.move_to_end(key)
                return
        while len(self) >= self.capacity:
            (self.probation or self.resumed).popitem(last=False)
            self.num_evictions += 1
        self.probation[key] = conv.clone(), recurrent.clone()

    def restore(self, key: int, cache: StateCache, slot: int) -> None:
        conv, recurrent = self.resumed.pop(key) if key in self.resumed else self.probation.pop(key)
        self.resumed[key] = conv, recurrent
        while len(self.resumed) > self.capacity - self.capacity // 4:
            oldest, state = self.resumed.popitem(last=False)
            self.probation[oldest] = state
        cache.conv[:, slot] = conv
        cache.recurrent[:, slot] = recurrent
        self.num_hits += 1
