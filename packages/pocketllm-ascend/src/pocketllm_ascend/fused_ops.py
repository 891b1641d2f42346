"""torch_npu's fused operators behind the torch backend's seams (``pocketllm_torch.fused_ops.FusedOps``).

Each replaces the torch ops of its seam with one CANN kernel: ``npu_rms_norm`` and ``npu_add_rms_norm``,
``npu_swiglu``, ``npu_rotary_mul`` (rotate-half and interleaved pairs), and ``npu_fused_infer_attention_score`` over
the context the engine gathers from its paged KV cache (BNSD layout, a boolean mask where True hides a key). That
kernel takes fp16 and bf16 only: float32 attention stays with the torch ops. It also reads a paged cache through a
block table, in a cache layout of [blocks, block size, kv heads x head dim] that is not the engine's [kv heads,
slots, head dim]; that form is not used yet.
"""

from __future__ import annotations

import torch
import torch_npu
from torch import Tensor

from pocketllm_torch.fused_ops import FusedOps

_ATTENTION_DTYPES = (torch.float16, torch.bfloat16)


class NpuFusedOps(FusedOps):
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def add_rms_norm(self, x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        normed, _, residual = torch_npu.npu_add_rms_norm(x, delta, weight, epsilon=eps)
        return residual, normed

    def silu_mul(self, gate_up: Tensor) -> Tensor:
        return torch_npu.npu_swiglu(gate_up, dim=-1)

    def rotary(self, x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool) -> Tensor:
        # x [T, heads, D] as [1, T, heads, D] (BSND); each angle over its two dimensions, in the mode's order.
        if interleaved:
            cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
        else:
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        r1, r2 = (t[None, :, None, :].to(x.dtype) for t in (cos, sin))
        mode = "interleave" if interleaved else "half"
        return torch_npu.npu_rotary_mul(x.contiguous().unsqueeze(0), r1.contiguous(), r2.contiguous(),
                                        rotary_mode=mode).squeeze(0)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
        if q.dtype not in _ATTENTION_DTYPES:
            return super().attention(q, k, v, mask, scale)
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q.contiguous(), k.contiguous(), v.contiguous(), atten_mask=(mask != 0).contiguous(), num_heads=q.shape[1],
            num_key_value_heads=k.shape[1], scale=scale, input_layout="BNSD")
        return out
