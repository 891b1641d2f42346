"""Matrices kept in 4-bit groups, as GGUF's Q4_0 and Q4_1 store them, for backends with a 4-bit kernel.

Both formats are affine per group of 32 weights along a row: ``w = scale * code + offset`` with codes in
[0, 15] (Q4_0: offset = -8 * scale). Handing a backend the codes instead of float32 arrays lets it keep a
quarter of the bytes and run kernels that stream them; dequantizing is still one call away.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TypeVar

import gguf
import numpy as np

GROUP_SIZE = 32
# The GGUF block types an Int4Groups represents exactly.
INT4_TYPES = frozenset({gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q4_1})

G = TypeVar("G", bound="GroupedMatrix")


class GroupedMatrix:
    """What the group formats (here and in ``int8``) share: dataclasses of codes [rows, cols] and per-group
    arrays [rows, cols // 32], every field with rows first."""

    __slots__ = ()
    codes: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # type: ignore[return-value]

    def code_groups(self) -> np.ndarray:
        """The codes as float32 [rows, cols // 32, 32]."""
        rows, cols = self.shape
        return self.codes.reshape(rows, cols // GROUP_SIZE, GROUP_SIZE).astype(np.float32)

    def map_rows(self: G, fn: Callable[[np.ndarray], np.ndarray]) -> G:
        """Apply the same row reordering (a function of the leading axis only) to every field."""
        return type(self)(*(fn(getattr(self, f.name)) for f in fields(self)))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Int4Groups(GroupedMatrix):
    """``w[r, c] = scale[r, c // 32] * codes[r, c] + offset[r, c // 32]``; rows are output features."""

    codes: np.ndarray  # uint8 [rows, cols], each in [0, 15]
    scale: np.ndarray  # float32 [rows, cols // 32]
    offset: np.ndarray  # float32 [rows, cols // 32]

    def dequantize(self) -> np.ndarray:
        return (self.code_groups() * self.scale[..., None] + self.offset[..., None]).reshape(self.shape)


def from_gguf_blocks(blocks: np.ndarray, qtype: gguf.GGMLQuantizationType, rows: int, cols: int) -> Int4Groups:
    """Unpack the raw bytes of a Q4_0/Q4_1 matrix of ``rows`` x ``cols`` (GGUF order: a row's blocks in turn)."""
    if qtype not in INT4_TYPES:
        raise ValueError(f"{qtype.name} is not a 4-bit affine format")
    if cols % GROUP_SIZE:
        raise ValueError(f"row length {cols} is not a multiple of {GROUP_SIZE}")
    header = 4 if qtype == gguf.GGMLQuantizationType.Q4_1 else 2
    blocks = np.ascontiguousarray(blocks).view(np.uint8).reshape(rows * cols // GROUP_SIZE, header + GROUP_SIZE // 2)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    offset = blocks[:, 2:4].copy().view(np.float16).astype(np.float32) if header == 4 else -8 * scale
    packed = blocks[:, header:]
    # Byte j of a block holds element j in its low nibble and element j + 16 in its high nibble.
    codes = np.concatenate((packed & 0x0F, packed >> 4), axis=1)
    groups = cols // GROUP_SIZE
    return Int4Groups(codes.reshape(rows, cols), scale.reshape(rows, groups), offset.reshape(rows, groups))
