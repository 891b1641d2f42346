"""Fused operators of a device: kernels that each replace a few torch ops of the models, where a platform has them.

``FusedOps`` is the interface a platform (see platform.py) implements, and its methods here are the torch
reference that an implementation must match (pocketllm-ascend's tests hold torch_npu's operators to them). The
models ask ``for_tensor(x)`` at each seam, which answers with the fused operators of the platform of x's device,
and keep their torch ops (or the CPU's native kernels, or Triton's on CUDA) when it answers None. Never while a
decode trace records: a trace records torch ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from pocketllm_torch import platform


class FusedOps:
    """The seams, each with the torch ops it replaces."""

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        """``x / sqrt(mean(x^2) + eps)`` over the last dimension in float32, cast to x's dtype, times ``weight``."""
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        return normed.to(x.dtype) * weight

    def add_rms_norm(self, x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        """The residual add before a norm: ``(x + delta, rms_norm(x + delta))``."""
        residual = x + delta
        return residual, self.rms_norm(residual, weight, eps)

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        """SwiGLU of a fused gate/up projection [..., 2 * I]: ``silu(gate) * up``."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rotary(self, x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool) -> Tensor:
        """RoPE of x [T, heads, D] by angles cos, sin [T, D / 2]: dimension pairs (2i, 2i + 1) when
        ``interleaved``, else (i, i + D / 2) (rotate-half)."""
        cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
        if interleaved:
            even, odd = x[..., 0::2], x[..., 1::2]
            return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
        first, second = x.chunk(2, dim=-1)
        return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
        """Attention of queries q [B, H, Q, D] over keys and values [B, Hkv, L, D] (query head h reads kv head
        h // (H / Hkv)) with an additive mask [B, 1, Q, L] (0 or -inf); returns [B, H, Q, D]."""
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def for_tensor(x: Tensor) -> FusedOps | None:
    """The fused operators for ops on ``x``, or None: the models' own."""
    if not platform.FUSED:
        return None
    ops = platform.FUSED.get(x.device.type)
    return None if ops is None or torch.jit.is_tracing() else ops
