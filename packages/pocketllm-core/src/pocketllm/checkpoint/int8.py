"""Matrices kept in 8-bit groups, as GGUF's Q8_0 stores them, for backends with an 8-bit kernel.

``w = scale * code`` per group of 32 weights along a row, codes in [-128, 127]: a quarter of float32's bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from pocketllm.checkpoint.int4 import GROUP_SIZE, GroupedMatrix

INT8_TYPES = frozenset({gguf.GGMLQuantizationType.Q8_0})


@dataclass(frozen=True, slots=True)
class Int8Groups(GroupedMatrix):
    """``w[r, c] = scale[r, c // 32] * codes[r, c]``; rows are output features."""

    codes: np.ndarray  # int8 [rows, cols]
    scale: np.ndarray  # float32 [rows, cols // 32]

    def dequantize(self) -> np.ndarray:
        return (self.code_groups() * self.scale[..., None]).reshape(self.shape)


def from_gguf_blocks(blocks: np.ndarray, qtype: gguf.GGMLQuantizationType, rows: int, cols: int) -> Int8Groups:
    """Unpack the raw bytes of a Q8_0 matrix of ``rows`` x ``cols`` (GGUF order: a row's blocks in turn)."""
    if qtype not in INT8_TYPES:
        raise ValueError(f"{qtype.name} is not an 8-bit group format")
    if cols % GROUP_SIZE:
        raise ValueError(f"row length {cols} is not a multiple of {GROUP_SIZE}")
    blocks = np.ascontiguousarray(blocks).view(np.uint8).reshape(rows * cols // GROUP_SIZE, 2 + GROUP_SIZE)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    codes = blocks[:, 2:].copy().view(np.int8)
    return Int8Groups(codes.reshape(rows, cols), scale.reshape(rows, cols // GROUP_SIZE))
