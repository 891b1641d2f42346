"""GGUF's 4- and 8-bit matrices multiplied where they lie: each program dequantizes a tile of weight groups into
registers and multiplies it at once, so that a GPU keeps the file's 4.5 or 8.5 bits per weight instead of a bf16
copy at load.

A group is 32 weights of a row with one scale (and, for 4-bit codes, one offset): Q4_0, Q4_1 and Q4_K
(``groups.Int4Groups``), Q8_0 (``Int8Groups``). 4-bit codes are kept two to a byte in GGUF's Q4_0 order: byte j
of a group holds weight j in its low nibble and weight j + 16 in its high one. The kernel multiplies the low
nibbles with the group's inputs 0-15 and the high ones with 16-31, so it never interleaves them back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from pocketllm_torch.groups import GROUP_SIZE


@triton.jit
def _grouped_matmul(x_ptr, codes_ptr, scale_ptr, offset_ptr, y_ptr, rows, outs, groups,
                    INT4: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, GROUPS: tl.constexpr):
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < rows
    n_ok = rn < outs
    cols = groups * 32
    half = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, groups, GROUPS):
        g = g0 + tl.arange(0, GROUPS)
        g_ok = g < groups
        w_ok = n_ok[:, None, None] & g_ok[None, :, None]
        x_ok = m_ok[:, None, None] & g_ok[None, :, None]
        per_group = rn[:, None] * groups + g[None, :]
        scale = tl.load(scale_ptr + per_group, mask=n_ok[:, None] & g_ok[None, :], other=0.0)[:, :, None]
        x_at = x_ptr + rm[:, None, None] * cols + g[None, :, None] * 32 + half[None, None, :]
        if INT4:
            offset = tl.load(offset_ptr + per_group, mask=n_ok[:, None] & g_ok[None, :], other=0.0)[:, :, None]
            packed = tl.load(codes_ptr + rn[:, None, None] * (cols // 2) + g[None, :, None] * 16 + half[None, None, :],
                             mask=w_ok, other=0)
        for part in tl.static_range(2):  # inputs 0-15 of each group, then 16-31
            if INT4:  # the low nibbles, then the high ones
                w = ((packed >> (4 * part)) & 15).to(tl.float32) * scale + offset
            else:
                codes = tl.load(codes_ptr + rn[:, None, None] * cols + g[None, :, None] * 32 + 16 * part
                                + half[None, None, :], mask=w_ok, other=0)
                w = codes.to(tl.float32) * scale
            x = tl.load(x_at + 16 * part, mask=x_ok, other=0.0)
            w = tl.reshape(w.to(x_ptr.dtype.element_ty), (BLOCK_N, GROUPS * 16))
            acc += tl.dot(tl.reshape(x, (BLOCK_M, GROUPS * 16)), tl.trans(w), input_precision=PRECISION)
    y_ok = m_ok[:, None] & n_ok[None, :]
    tl.store(y_ptr + rm[:, None] * outs + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=y_ok)


def pack_int4(codes: Tensor) -> Tensor:
    """uint8 codes [out, in] (each 0..15) -> [out, in / 2]: byte j of each group of 32 is code j | code j + 16 << 4."""
    out, cols = codes.shape
    grouped = codes.to(torch.uint8).view(out, cols // GROUP_SIZE, 2, GROUP_SIZE // 2)
    return (grouped[:, :, 0] | (grouped[:, :, 1] << 4)).reshape(out, cols // 2).contiguous()


def grouped_matmul(x: Tensor, codes: Tensor, scale: Tensor, offset: Tensor | None,
                   out_dtype: torch.dtype | None = None) -> Tensor:
    """x [T, in] times the grouped weight [out, in] transposed: ``scale * code (+ offset)`` per group of 32 inputs.

    ``codes``: ``pack_int4``'s bytes [out, in / 2] with ``offset`` (4-bit), or int8 [out, in] without (8-bit);
    ``scale`` and ``offset`` float32 [out, in / 32]. Products accumulate in float32; the output is ``out_dtype``
    (x's dtype by default)."""
    x = x.contiguous()
    rows, cols = x.shape
    outs, groups = scale.shape
    if cols != groups * GROUP_SIZE:
        raise ValueError(f"inputs of {cols} columns against a weight of {groups} groups of {GROUP_SIZE}")
    y = x.new_empty(rows, outs, dtype=out_dtype or x.dtype)
    block_m = 16 if rows <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(rows, block_m), triton.cdiv(outs, block_n))
    _grouped_matmul[grid](x, codes, scale, scale if offset is None else offset, y, rows, outs, groups,
                          INT4=offset is not None,
                          # float32 inputs multiplied as float32, not TF32 (triton's default, which others ignore)
                          PRECISION="ieee" if x.dtype == torch.float32 else "tf32", BLOCK_M=block_m, BLOCK_N=block_n,
                          GROUPS=4)
    return y
