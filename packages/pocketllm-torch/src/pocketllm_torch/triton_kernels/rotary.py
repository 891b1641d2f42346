"""Rotary position embeddings on each head's first ``rotary_dim`` values (the rest untouched: partial rotary), in
either pairing the torch backend uses: interleaved pairs (2i, 2i + 1) (Llama and Qwen3, whose q/k rows the loader
reorders so) or halves (i, i + rotary_dim / 2) (Qwen3.5's rotate-half)."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rotary(x_ptr, cos_ptr, sin_ptr, token_stride, head_stride, half_rotary, HALF: tl.constexpr,
            INTERLEAVED: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, HALF)
    mask = i < half_rotary
    cos = tl.load(cos_ptr + token * half_rotary + i, mask=mask, other=1.0)
    sin = tl.load(sin_ptr + token * half_rotary + i, mask=mask, other=0.0)
    base = x_ptr + token * token_stride + head * head_stride
    if INTERLEAVED:
        first, second = base + 2 * i, base + 2 * i + 1
    else:
        first, second = base + i, base + half_rotary + i
    real = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    imag = tl.load(second, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (real * cos - imag * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(second, (real * sin + imag * cos).to(x_ptr.dtype.element_ty), mask=mask)


def rotary_(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool) -> None:
    """Rotate x [T, H, D] in place (any strides but a contiguous last axis: q and k of one projection's output
    together, say) by each token's angles: cos and sin [T, rotary_dim / 2]."""
    tokens, heads, head_dim = x.shape
    half = cos.shape[-1]
    if x.stride(-1) != 1 or 2 * half > head_dim or cos.shape != (tokens, half) or sin.shape != cos.shape:
        raise ValueError(f"x {list(x.shape)} needs a contiguous last axis, and cos and sin [{tokens}, <= "
                         f"{head_dim // 2}]")
    _rotary[(tokens, heads)](x, cos.contiguous(), sin.contiguous(), x.stride(0), x.stride(1), half,
                             HALF=triton.next_power_of_2(half), INTERLEAVED=interleaved)
