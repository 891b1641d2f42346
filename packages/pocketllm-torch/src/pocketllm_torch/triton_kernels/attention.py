"""Paged attention for prefill chunks and decode alike (as vLLM's unified attention): one program per (token,
kv head) reads the token's context through its sequence's block table with an online softmax, the query heads
that share the kv head as the rows of one tile (GQA), causal by the token's position. The cache is the torch
backend's layer view [2, kv heads, slots, head dim] (slot = block * block_size + offset), written before the call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

KEYS_PER_ITERATION = 16  # keys of one tile: the smallest tl.dot dimension


@triton.jit
def _paged_attention(q_ptr, cache_ptr, tables_ptr, seq_ptr, pos_ptr, out_ptr, heads, kv_heads, head_dim, slots,
                     table_stride, block_size, scale, k_scale, v_scale, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # offsets in 64 bits: a layer's cache may pass 2^31 values
    kv_head = tl.program_id(1).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    rows = (g < GROUP)[:, None] & (d < head_dim)[None, :]
    seq = tl.load(seq_ptr + token)
    pos = tl.load(pos_ptr + token)
    q_offsets = (token * heads + kv_head * GROUP + g)[:, None] * head_dim + d[None, :]
    q = tl.load(q_ptr + q_offsets, mask=rows, other=0.0).to(tl.float32)
    running_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    keys = cache_ptr + kv_head * slots * head_dim
    values = cache_ptr + (kv_heads + kv_head) * slots * head_dim
    for start in range(0, pos + 1, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        visible = j <= pos
        block = tl.load(tables_ptr + seq * table_stride + j // block_size, mask=visible, other=0)
        slot = (block * block_size + j % block_size).to(tl.int64)
        kv_mask = visible[:, None] & (d < head_dim)[None, :]
        k = tl.load(keys + slot[:, None] * head_dim + d[None, :], mask=kv_mask, other=0.0).to(tl.float32) * k_scale
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        total = total * correction + tl.sum(p, axis=1)
        v = tl.load(values + slot[:, None] * head_dim + d[None, :], mask=kv_mask, other=0.0).to(tl.float32) * v_scale
        acc = acc * correction[:, None] + tl.dot(p, v, input_precision=PRECISION)
        running_max = new_max
    out = acc / total[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=rows)


def paged_attention(q: Tensor, kv_cache: Tensor, block_tables: Tensor, token_seq: Tensor, token_pos: Tensor,
                    block_size: int, scale: float, *, k_scale: float = 1.0, v_scale: float = 1.0,
                    exact: bool = True) -> Tensor:
    """Attention of q [T, H, D] over kv_cache [2, Hkv, slots, D]: token t attends its sequence token_seq[t]'s
    positions 0..token_pos[t] through block_tables [B, N]. Returns [T, H * D] in q's dtype. ``k_scale`` and
    ``v_scale`` multiply the cached values (an fp8 cache's per-tensor scales); ``exact``: float32 products on GPUs
    (tf32 otherwise)."""
    tokens, heads, head_dim = q.shape
    kv_heads, slots = kv_cache.shape[1], kv_cache.shape[2]
    if heads % kv_heads or kv_cache.shape[3] != head_dim:
        raise ValueError(f"q [{tokens}, {heads}, {head_dim}] does not fit the cache {list(kv_cache.shape)}")
    group = heads // kv_heads
    out = torch.empty_like(q)
    tables = block_tables.contiguous()
    _paged_attention[(tokens, kv_heads)](
        q.contiguous(), kv_cache.contiguous(), tables, token_seq.contiguous(), token_pos.contiguous(), out, heads,
        kv_heads, head_dim, slots, tables.shape[1], block_size, scale, k_scale, v_scale, GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=KEYS_PER_ITERATION, PRECISION="ieee" if exact else "tf32")
    return out.view(tokens, heads * head_dim)
