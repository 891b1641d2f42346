"""The KV cache zeroes a block on its first use, and only then."""

from __future__ import annotations

import torch

from pocketllm_torch.attention import KVCache


def test_blocks_are_zeroed_on_first_use_only() -> None:
    cache = KVCache(2, 6, 4, 1, 8, torch.float32, torch.device("cpu"))
    assert cache.blocks[:, :, :, 0].eq(0).all()  # the null block that padding reads
    cache.blocks[:, :, :, 1:].fill_(float("nan"))  # what torch.empty may hand back
    cache.zero_new_blocks([[3, 1]])
    assert cache.blocks[:, :, :, [0, 1, 3]].eq(0).all()
    assert cache.blocks[:, :, :, [2, 4, 5]].isnan().all()
    cache.layers[1][0, 0, 3 * 4] = 5.0  # layer 1's key at block 3, offset 0: a block in use keeps its contents
    cache.zero_new_blocks([[3, 2]])
    assert cache.blocks[1, 0, 0, 3, 0] == 5.0
    assert cache.blocks[:, :, :, 2].eq(0).all()
