"""Paged attention over this backend's KV cache, in plain torch.

The cache of one layer is a tensor [2, num_slots, num_kv_heads, head_dim] where slot = block_id * block_size +
offset. A step writes its new keys and values into their slots, gathers every sequence's context into a padded
[B, L, ...] batch and runs one ``scaled_dot_product_attention`` over it, with a mask that is causal and hides
padding. Block 0 is never allocated and stays zero: padding reads it, so no uninitialised memory reaches SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

NULL_SLOT = 0  # in block 0, which the block manager never hands out


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: Tensor  # [T]: cache slot of each new token
    context_slots: Tensor  # [B, L]: cache slot of each sequence's positions 0..L-1, NULL_SLOT past its end
    mask: Tensor  # [B, 1, Q, L]: 0 where query row q of a sequence may attend its position l, else -inf
    query_index: Tensor | None  # [B * Q]: token behind each padded query row; None when each sequence has one token
    token_index: Tensor | None  # [T]: padded query row of each token; None likewise


def build_metadata(starts: list[int], lengths: list[int], block_tables: list[list[int]], block_size: int,
                   device: torch.device, dtype: torch.dtype) -> tuple[Tensor, AttentionMetadata]:
    """Positions of the step's tokens, and the attention metadata shared by every layer.

    Sequence b computes tokens at positions starts[b] .. starts[b] + lengths[b] - 1, after its cached context.
    """
    start = torch.tensor(starts)
    length = torch.tensor(lengths)
    context_len = start + length
    max_context, max_query = int(context_len.max()), max(lengths)
    num_blocks = -(-max_context // block_size)
    table = torch.tensor([t[:num_blocks] + [0] * (num_blocks - len(t)) for t in block_tables])
    pos = torch.arange(max_context)
    context_slots = table[:, pos // block_size] * block_size + pos % block_size
    context_slots = torch.where(pos < context_len[:, None], context_slots, NULL_SLOT)

    row = torch.arange(max_query)
    valid = row < length[:, None]  # [B, Q]
    # Padding rows sit at position 0: attending one real key keeps their (discarded) output finite.
    query_pos = torch.where(valid, start[:, None] + row, 0)
    # Additive, in the activations' dtype: SDPA would otherwise convert a boolean mask in every layer.
    mask = torch.zeros(query_pos.shape + pos.shape, dtype=dtype).masked_fill_(pos > query_pos[:, :, None],
                                                                              float("-inf")).unsqueeze(1)
    slot_mapping = context_slots.gather(1, query_pos)[valid]
    if max_query == 1:
        query_index = token_index = None
    else:
        first_token = torch.cumsum(length, 0) - length
        query_index = torch.where(valid, first_token[:, None] + row, 0).flatten().to(device)
        token_index = valid.flatten().nonzero().squeeze(1).to(device)
    meta = AttentionMetadata(slot_mapping.to(device), context_slots.to(device), mask.to(device), query_index,
                             token_index)
    return query_pos[valid].to(device), meta


def paged_attention(q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
                    scale: float) -> Tensor:
    """Attention of the step's queries q [T, H, D] over the cached context plus the new k, v [T, Hkv, D].

    Returns [T, H * D]. ``kv_cache`` is this layer's [2, num_slots, Hkv, D] cache, updated in place.
    """
    kv_cache[0].index_copy_(0, meta.slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].index_copy_(0, meta.slot_mapping, v.to(kv_cache.dtype))
    batch, _, max_query, context_len = meta.mask.shape
    # index_select over flat slots is several times faster than advanced indexing with a 2-D index.
    kv = kv_cache.flatten(2).index_select(1, meta.context_slots.flatten()).to(q.dtype)
    keys, values = kv.view(2, batch, context_len, *k.shape[1:]).transpose(2, 3).unbind(0)  # [B, Hkv, L, D]
    queries = q if meta.query_index is None else q[meta.query_index]
    out = F.scaled_dot_product_attention(queries.view(batch, max_query, *q.shape[1:]).transpose(1, 2), keys, values,
                                         attn_mask=meta.mask, scale=scale, enable_gqa=True)
    out = out.transpose(1, 2).reshape(batch * max_query, -1)
    return out if meta.token_index is None else out[meta.token_index]
