"""Paged attention over this backend's KV cache, in plain torch.

The cache of one layer is a tensor [2, num_kv_heads, num_slots, head_dim] where slot = block_id * block_size +
offset. A step writes its new keys and values into their slots and gathers every sequence's context, block by
block, into a padded [kv heads, B, L, D] batch (L a whole number of blocks), with a mask that is causal and hides
padding. Block 0 is never allocated and stays zero: padding reads it. Whole blocks are copied because a gather
of 4 KB runs is several times faster than one of single slots; the unwritten tail of a sequence's last block is
masked, and :class:`KVCache` zeroes each block before its first use so that no uninitialised memory (possibly
NaN, which a -inf mask would not hide) reaches the matmuls.

Prefill runs ``scaled_dot_product_attention``. Decode (one query per sequence) runs the native kernel
(``native.paged_decode_attention``) on CPUs where it is built: it reads each sequence's keys and values through
its block table, with no gathered copy. Elsewhere decode runs two batched matmuls, which beat SDPA's CPU kernel
at a single query row: the heads-first layout makes the gathered keys of each (kv head, sequence) pair one
contiguous matrix, and the query heads sharing a kv head are its rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from pocketllm_torch import fused_ops, native, triton_ops

if TYPE_CHECKING:
    from collections.abc import Iterable

NULL_BLOCK = 0  # never handed out by the block manager
# kv_cache_dtype="fp8": e4m3 with a per-tensor scale of 1 (vLLM's default where a checkpoint carries no calibrated
# scales), values past the format's largest, 448, saturated. torch's CPU kernels lack index_fill_ and index_copy_
# for it, so the cache's writes go through its bytes.
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _bytes(cache: Tensor) -> Tensor:
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def store_kv(kv_cache: Tensor, slot_mapping: Tensor, kv: Tensor) -> None:
    """Write new keys and values [2, Hkv, T, D] into their slots of a layer's cache [2, Hkv, slots, D]."""
    if kv_cache.dtype == FP8:
        kv = kv.clamp(-FP8_MAX, FP8_MAX).to(FP8)
    _bytes(kv_cache).index_copy_(2, slot_mapping, _bytes(kv.to(kv_cache.dtype)))


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: Tensor  # [T]: cache slot of each new token
    context_blocks: Tensor  # [B, N]: each sequence's first N blocks, NULL_BLOCK past its end
    context_lens: Tensor  # [B]: each sequence's context length once this step's tokens are cached
    mask: Tensor  # [B, 1, Q, L]: 0 where query row q of a sequence may attend its position l, else -inf
    query_index: Tensor | None  # [B * Q]: token behind each padded query row; None when each sequence has one token
    token_index: Tensor | None  # [T]: padded query row of each token; None likewise
    # [T] each token's sequence and position, for the Triton kernel; None: one token per sequence, the last of its
    # context (a decode step, whose trace does not carry them)
    token_seq: Tensor | None = None
    token_pos: Tensor | None = None


def build_metadata(starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int,
                   device: torch.device, dtype: torch.dtype) -> tuple[Tensor, AttentionMetadata]:
    """Positions of the step's tokens, and the attention metadata shared by every layer.

    Sequence b computes tokens at positions starts[b] .. starts[b] + lengths[b] - 1, after its cached context.
    """
    start = torch.tensor(starts)
    length = torch.tensor(lengths)
    num_blocks = -(-int((start + length).max()) // block_size)
    table = torch.tensor([t[:num_blocks] + [NULL_BLOCK] * (num_blocks - len(t)) for t in block_tables])
    pos = torch.arange(num_blocks * block_size)

    row = torch.arange(max(lengths))
    valid = row < length[:, None]  # [B, Q]
    # Padding rows sit at position 0: attending one real key keeps their (discarded) output finite.
    query_pos = torch.where(valid, start[:, None] + row, 0)
    # Additive, in the activations' dtype: SDPA would otherwise convert a boolean mask in every layer.
    mask = torch.zeros(query_pos.shape + pos.shape, dtype=dtype).masked_fill_(pos > query_pos[:, :, None],
                                                                              float("-inf")).unsqueeze(1)
    slot_mapping = (table.gather(1, query_pos // block_size) * block_size + query_pos % block_size)[valid]
    if row.numel() == 1:
        query_index = token_index = None
    else:
        first_token = torch.cumsum(length, 0) - length
        query_index = torch.where(valid, first_token[:, None] + row, 0).flatten().to(device)
        token_index = valid.flatten().nonzero().squeeze(1).to(device)
    positions = query_pos[valid].to(device)
    token_seq = torch.repeat_interleave(torch.arange(len(lengths)), length).to(device)
    meta = AttentionMetadata(slot_mapping.to(device), table.to(device), (start + length).to(device), mask.to(device),
                             query_index, token_index, token_seq, positions)
    return positions, meta


class KVCache:
    """Every layer's cache, in one allocation; ``layers[i]`` is layer i's [2, kv heads, slots, head dim] view.

    torch.empty leaves pages untouched until a block is first used, so an idle cache costs no memory; a block
    is zeroed on its first use instead (see the module docstring).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.blocks = torch.empty(num_layers, 2, num_kv_heads, num_blocks, block_size * head_dim, dtype=dtype,
                                  device=device)
        self.layers = list(self.blocks.view(num_layers, 2, num_kv_heads, num_blocks * block_size, head_dim).unbind(0))
        self._zeroed = bytearray(num_blocks)
        self.zero_new_blocks([[NULL_BLOCK]])

    def zero_new_blocks(self, block_tables: Iterable[list[int]]) -> None:
        """Zero the blocks of these tables that were never used before."""
        new = {b for table in block_tables for b in table if not self._zeroed[b]}
        if new:
            _bytes(self.blocks).index_fill_(3, torch.tensor(sorted(new), device=self.blocks.device), 0)
            for b in new:
                self._zeroed[b] = 1


def paged_attention(q: Tensor, kv: Tensor, kv_cache: Tensor, meta: AttentionMetadata, scale: float) -> Tensor:
    """Attention of the step's queries q [T, H, D] over the cached context plus the new keys and values.

    ``kv`` [2, Hkv, T, D] holds the new keys and values; returns [T, H * D]. ``kv_cache`` is this layer's
    [2, Hkv, num_slots, D] cache, updated in place.
    """
    store_kv(kv_cache, meta.slot_mapping, kv)
    batch, _, max_query, context_len = meta.mask.shape
    if triton_ops.use_triton(kv_cache):
        token_seq, token_pos = meta.token_seq, meta.token_pos
        if token_seq is None or token_pos is None:  # one token per sequence, the last of its context
            token_seq, token_pos = torch.arange(batch, device=q.device), meta.context_lens - 1
        block_size = context_len // meta.context_blocks.shape[1]
        return triton_ops.paged_attention(q, kv_cache, meta.context_blocks, token_seq, token_pos, block_size, scale)
    if meta.query_index is None and _native_decode(q, kv_cache):
        block_size = context_len // meta.context_blocks.shape[1]
        return native.paged_decode_attention(q.contiguous(), kv_cache, meta.context_blocks, meta.context_lens,
                                             block_size, scale).to(q.dtype)
    kv_heads, dim = kv.shape[1], kv.shape[3]
    blocks = kv_cache.view(2, kv_heads, -1, context_len // meta.context_blocks.shape[1] * dim)
    context = blocks.index_select(2, meta.context_blocks.flatten()).to(q.dtype)  # [2, Hkv, B * N, block * D]
    keys, values = context.view(2, kv_heads * batch, context_len, dim).unbind(0)
    ops = fused_ops.for_tensor(q)
    if meta.query_index is None and ops is None:
        return _decode_attention(q, keys, values, meta.mask, scale)
    queries = (q.unsqueeze(2) if meta.query_index is None
               else q[meta.query_index].view(batch, max_query, -1, dim).transpose(1, 2))
    keys, values = (t.view(kv_heads, batch, context_len, dim).transpose(0, 1) for t in (keys, values))
    if ops is not None:
        out = ops.attention(queries, keys, values, meta.mask, scale)
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=meta.mask, scale=scale, enable_gqa=True)
    if meta.query_index is None:
        return out.reshape(batch, -1)
    return out.transpose(1, 2).reshape(batch * max_query, -1)[meta.token_index]


def _native_decode(q: Tensor, kv_cache: Tensor) -> bool:
    return kv_cache.device.type == "cpu" and q.dtype == kv_cache.dtype == torch.float32 and native.enabled()


def _decode_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, scale: float) -> Tensor:
    """One query per sequence: q [B, H, D]; keys and values [Hkv * B, L, D]; mask [B, 1, 1, L]."""
    batch, heads, dim = q.shape
    kv_heads = keys.shape[0] // batch
    group = heads // kv_heads  # query heads h = kv_head * group + g share kv head h // group
    queries = q.view(batch, kv_heads, group, dim).transpose(0, 1).reshape(kv_heads * batch, group, dim)
    scores = torch.bmm(queries, keys.transpose(1, 2)).view(kv_heads, batch, group, -1)
    scores = scores.mul_(scale).add_(mask.view(1, batch, 1, -1)).view(kv_heads * batch, group, -1)
    out = torch.bmm(scores.softmax(-1), values)  # [Hkv * B, group, D]
    return out.view(kv_heads, batch, heads * dim // kv_heads).transpose(0, 1).reshape(batch, heads * dim)
