"""Gated DeltaNet's decode step (Qwen3.5's linear-attention layers), one token per sequence with its state slot:
the causal convolution's update, and the recurrent delta rule on the fp32 state, both in place in the slot pools.
Prefill chunks keep the torch path (or fla-core's chunked kernel on GPUs)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _conv_update(x_ptr, conv_ptr, slots_ptr, weight_ptr, out_ptr, channels, WIDTH: tl.constexpr,
                 BLOCK_C: tl.constexpr):
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = c < channels
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    state = conv_ptr + slot * channels * WIDTH + c * WIDTH
    x = tl.load(x_ptr + seq * channels + c, mask=mask, other=0.0).to(tl.float32)
    # The window is the state's WIDTH inputs then x; its dot with the kernel of WIDTH + 1 taps.
    total = x * tl.load(weight_ptr + c * (WIDTH + 1) + WIDTH, mask=mask, other=0.0).to(tl.float32)
    previous = tl.load(state, mask=mask, other=0.0)
    for i in tl.static_range(WIDTH):
        value = previous
        if i + 1 < WIDTH:
            previous = tl.load(state + i + 1, mask=mask, other=0.0)
            tl.store(state + i, previous, mask=mask)  # the window moves on
        else:
            tl.store(state + i, x.to(conv_ptr.dtype.element_ty), mask=mask)
        total += value.to(tl.float32) * tl.load(weight_ptr + c * (WIDTH + 1) + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + seq * channels + c, (total / (1.0 + tl.exp(-total))).to(out_ptr.dtype.element_ty), mask=mask)


def conv_update(x: Tensor, conv: Tensor, slots: Tensor, weight: Tensor) -> Tensor:
    """silu of the causal convolution of each sequence's window (its slot's last inputs, then x [B, C]) with
    weight [C, kernel]; conv [slots, C, kernel - 1] moves on by one input. Returns [B, C] float32."""
    batch, channels = x.shape
    width = conv.shape[-1]
    if weight.shape != (channels, width + 1) or conv.shape[1] != channels or not conv.is_contiguous():
        raise ValueError(f"conv state {list(conv.shape)} and weight {list(weight.shape)} do not fit x {list(x.shape)}")
    out = torch.empty(batch, channels, dtype=torch.float32, device=x.device)
    block = min(256, triton.next_power_of_2(channels))
    _conv_update[(batch, triton.cdiv(channels, block))](x.contiguous(), conv, slots.contiguous(), weight.contiguous(),
                                                        out, channels, WIDTH=width, BLOCK_C=block)
    return out


@triton.jit
def _delta_step(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, out_ptr, heads, k_dim, v_dim,
                BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # this program's value columns of the state
    i = tl.arange(0, BLOCK_K)
    i_mask, j_mask = i < k_dim, j < v_dim
    row = seq * heads + head
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    offsets = (slot * heads + head) * k_dim * v_dim + i[:, None] * v_dim + j[None, :]
    mask = i_mask[:, None] & j_mask[None, :]
    state = tl.load(state_ptr + offsets, mask=mask, other=0.0)
    q = tl.load(q_ptr + row * k_dim + i, mask=i_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * k_dim + i, mask=i_mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * v_dim + j, mask=j_mask, other=0.0).to(tl.float32)
    state = state * tl.exp(tl.load(g_ptr + row).to(tl.float32))
    remembered = tl.sum(k[:, None] * state, axis=0)
    state = state + k[:, None] * ((v - remembered) * tl.load(beta_ptr + row).to(tl.float32))[None, :]
    tl.store(state_ptr + offsets, state, mask=mask)
    tl.store(out_ptr + row * v_dim + j, tl.sum(q[:, None] * state, axis=0), mask=j_mask)


def delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slots: Tensor) -> Tensor:
    """One token of each of B sequences through the gated delta rule: q, k [B, H, dk], v [B, H, dv], g and beta
    [B, H]; state [slots, H, dk, dv] float32, each sequence's slot updated in place. Returns [B, H, dv] float32."""
    batch, heads, k_dim = q.shape
    v_dim = v.shape[-1]
    if state.dtype != torch.float32 or state.shape[1:] != (heads, k_dim, v_dim) or not state.is_contiguous():
        raise ValueError(f"state {list(state.shape)} ({state.dtype}) does not fit q {list(q.shape)}, v {list(v.shape)}")
    out = torch.empty(batch, heads, v_dim, dtype=torch.float32, device=q.device)
    block_v = min(32, triton.next_power_of_2(v_dim))
    _delta_step[(batch, heads, triton.cdiv(v_dim, block_v))](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), state, slots.contiguous(),
        out, heads, k_dim, v_dim, BLOCK_K=triton.next_power_of_2(k_dim), BLOCK_V=block_v)
    return out
