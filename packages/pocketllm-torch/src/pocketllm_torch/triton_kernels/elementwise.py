"""Row-wise kernels: RMSNorm (with the residual add before it) and SwiGLU, one program per row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rms_norm(x_ptr, delta_ptr, weight_ptr, out_ptr, residual_ptr, cols, eps, HAS_DELTA: tl.constexpr,
              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.arange(0, BLOCK)
    mask = offsets < cols
    x = tl.load(x_ptr + row * cols + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x = x + tl.load(delta_ptr + row * cols + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(residual_ptr + row * cols + offsets, x.to(residual_ptr.dtype.element_ty), mask=mask)
    scale = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / cols + eps)
    # As Hugging Face's RMSNorm: normalised in float32, cast to the activations' dtype, then times the weight.
    normed = (x * scale).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + row * cols + offsets, normed * weight, mask=mask)


def rms_norm(x: Tensor, weight: Tensor, eps: float, delta: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(norm, residual) of rows x [T, C]: residual = x + delta (x itself without delta), norm = rms_norm(residual)
    * weight, in x's dtype."""
    x = x.contiguous()
    rows, cols = x.shape
    out = torch.empty_like(x)
    residual = torch.empty_like(x) if delta is not None else x
    _rms_norm[(rows,)](x, x if delta is None else delta.contiguous(), weight, out, residual, cols, eps,
                       HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(cols))
    return out, residual


@triton.jit
def _silu_mul(gate_up_ptr, out_ptr, cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < cols
    gate = tl.load(gate_up_ptr + row * 2 * cols + offsets, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * cols + cols + offsets, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * cols + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of gate_up [T, 2I] (gate first, as the fused projection stores them) -> [T, I]."""
    gate_up = gate_up.contiguous()
    rows, cols = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, cols)
    block = min(1024, triton.next_power_of_2(cols))
    _silu_mul[(rows, triton.cdiv(cols, block))](gate_up, out, cols, BLOCK=block)
    return out
