"""Hands out the KV cache's fixed-size blocks: a free list plus a reference count per block.

With prefix caching, every full block a sequence computes is filed under a hash of its tokens chained with
the hash of the block before it, so the hash names the whole prefix. A new sequence adopts the cached blocks
of its longest cached prefix instead of recomputing them. A freed block keeps its contents and its hash until
it is handed out again, least recently freed first.

Freed blocks that hold no cached prefix are handed out before any other, most recently freed first: their
memory is already paged in (and warm in CPU caches), so a long-running engine without prefix caching touches
only as much of its lazily allocated cache as its busiest moment needed, not all of it.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pocketllm_torch.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Block 0 is never handed out: attention padding reads its zeros (see attention.NULL_BLOCK).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks + 1))
        self.ref_counts = [0] * (num_blocks + 1)
        self.cached_block_ids: dict[int, int] = {}  # prefix hash -> block holding that prefix's last block
        self.block_hashes: dict[int, int] = {}  # the reverse, for blocks still cached
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_block_ids)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that ``seq`` can hold its first ``num_tokens`` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free_block_ids)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_tokens)):
            block_id, _ = self.free_block_ids.popitem(last=False)
            if (stale := self.block_hashes.pop(block_id, None)) is not None:
                del self.cached_block_ids[stale]
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Free ``seq``'s blocks past its first ``num_tokens`` tokens (what a rejected draft had reserved)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    def free(self, seq: Sequence) -> None:
        # Tail blocks first, so that they are reused before the prefixes other requests may share.
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table.clear()
        seq.block_hashes.clear()

    def _release(self, block_id: int) -> None:
        """Drop one reference; a block nobody holds is free again, first in line unless it holds a cached prefix."""
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_block_ids[block_id] = None
            if block_id not in self.block_hashes:
                self.free_block_ids.move_to_end(block_id, last=False)

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Hashes of the cached full blocks that start ``seq``; its last token is always left to compute."""
        hashes: list[int] = []
        if self.enable_prefix_caching:
            for start in range(0, seq.num_tokens - self.block_size, self.block_size):
                key = _hash(hashes, seq.token_ids[start:start + self.block_size])
                if key not in self.cached_block_ids:
                    break
                hashes.append(key)
        return hashes

    def can_admit(self, seq: Sequence, prefix: list[int], num_tokens: int) -> bool:
        """Whether ``seq``, with no blocks yet, fits its first ``num_tokens`` tokens after adopting ``prefix``."""
        adopted = [self.cached_block_ids[key] for key in prefix]
        num_new = -(-num_tokens // self.block_size) - len(adopted)
        return num_new + sum(self.ref_counts[b] == 0 for b in adopted) <= len(self.free_block_ids)

    def admit(self, seq: Sequence, prefix: list[int], num_tokens: int) -> None:
        """Give ``seq`` the blocks of its cached ``prefix``, marked computed, and fresh ones up to ``num_tokens``."""
        for key in prefix:
            block_id = self.cached_block_ids[key]
            if self.ref_counts[block_id] == 0:
                del self.free_block_ids[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.block_hashes.extend(prefix)
        seq.num_computed_tokens = len(prefix) * self.block_size
        if self.enable_prefix_caching:
            self.num_queried_tokens += seq.num_tokens
            self.num_hit_tokens += seq.num_computed_tokens
        self.allocate(seq, num_tokens)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """File the blocks that ``seq`` has filled since the last call."""
        if not self.enable_prefix_caching:
            return
        for index in range(len(seq.block_hashes), seq.num_computed_tokens // self.block_size):
            start = index * self.block_size
            key = _hash(seq.block_hashes, seq.token_ids[start:start + self.block_size])
            seq.block_hashes.append(key)
            block_id = seq.block_table[index]
            if key not in self.cached_block_ids:  # else an identical block computed alongside is already filed
                self.cached_block_ids[key] = block_id
                self.block_hashes[block_id] = key


def _hash(previous: list[int], tokens: list[int]) -> int:
    return hash((previous[-1] if previous else None, tuple(tokens)))
