"""KV-cache sizing for every backend: how many blocks a memory budget buys.

A backend measures its device (a fraction of physical RAM; on a GPU, the memory its weights left free) and its
model (bytes per block, per state slot); this module turns that into a number of blocks and refuses what cannot
work, with one rule for all: a sequence at ``max_model_len`` must fit alone (or preemption could never make
progress), and an explicit ``num_kv_blocks`` must fit the device.
"""

from __future__ import annotations

import msgspec

from pocketllm.errors import ConfigError


def bytes_per_block(*, num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int, block_size: int) -> int:
    """Keys and values of ``block_size`` tokens across ``num_layers`` attention layers."""
    return 2 * num_layers * num_kv_heads * head_dim * itemsize * block_size


class KVBudget(msgspec.Struct, frozen=True, kw_only=True):
    """What sizes one engine's (or one tensor-parallel rank's) KV cache."""

    block_size: int
    bytes_per_block: int
    max_model_len: int
    max_num_seqs: int
    memory_bytes: int
    """What the KV cache, the state slots and the snapshots may take together: the engine's share of its device."""
    device_bytes: int
    """All the device has, which an explicit number of blocks (with the states) must fit in."""
    state_slot_bytes: int = 0
    """Hybrid models: each running sequence's state-layer slot (``max_num_seqs`` of them are held)."""
    snapshot_bytes: int = 0
    """Hybrid models with prefix caching: the budget of the state snapshots, memory they may come to hold."""

    @property
    def blocks_per_sequence(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def state_bytes(self) -> int:
        """What the states take out of the budget before the KV cache gets any."""
        return self.max_num_seqs * self.state_slot_bytes + self.snapshot_bytes

    def num_blocks(self, requested: int | None = None) -> int:
        """``requested`` (the ``num_kv_blocks`` option) if given, else blocks for every sequence at full length
        unless that exceeds what the budget holds once the states have their share. ConfigError when the device
        cannot hold ``requested`` blocks, or when the blocks cannot hold one sequence."""
        if requested is not None:
            if requested * self.bytes_per_block + self.state_bytes > self.device_bytes:
                raise ConfigError("backend_options", f"{requested} KV blocks of {self.bytes_per_block} bytes need "
                                                     "more memory than this device has")
            num_blocks = requested
        else:
            affordable = max(0, self.memory_bytes - self.state_bytes) // self.bytes_per_block
            num_blocks = min(self.max_num_seqs * self.blocks_per_sequence, affordable)
        if num_blocks < self.blocks_per_sequence:
            budget = "" if requested is not None else (
                f" (what {self.memory_bytes} bytes of KV memory hold after {self.state_bytes} for state slots and "
                "snapshots)" if self.state_bytes else f" (what {self.memory_bytes} bytes of KV memory hold)")
            raise ConfigError("backend_options", f"{num_blocks} KV blocks of {self.block_size} tokens{budget} "
                                                 f"cannot hold one sequence of max_model_len={self.max_model_len}")
        return num_blocks


def snapshot_capacity(snapshot_bytes: int, bytes_per_snapshot: int, *, option: str) -> int:
    """How many state snapshots (every state layer's, at one block boundary) fit their budget, which the backend
    option ``option`` sets; ConfigError naming it if none does."""
    capacity = snapshot_bytes // bytes_per_snapshot
    if capacity == 0:
        raise ConfigError(f"backend_options.{option}", f"{snapshot_bytes >> 20} MiB holds no snapshot of this "
                                                       f"model's states ({bytes_per_snapshot} bytes each)")
    return capacity
