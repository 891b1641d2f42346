"""GGUF's 4- and 8-bit matrices kept in their groups, unpacked from a checkpoint tensor's raw blocks, and FP8
matrices with their scales per group.

Q4_0 and Q4_1 are affine per group of 32 weights along a row: ``w = scale * code + offset`` with codes in
[0, 15] (Q4_0: offset = -8 * scale); Q8_0 is ``w = scale * code`` with codes in [-128, 127]. Handing the
kernels the codes instead of float32 arrays keeps a quarter of the bytes; ``linear.Int4Weight`` and
``Int8Weight`` dequantize them when a dense copy is needed. An FP8 (E4M3) matrix keeps its bytes, with its
scales (per 128 x 128 block, row or tensor in the file) given per group of 32 like the others', so that splitting
and stacking rows or whole groups of columns treat it alike; ``linear.Fp8Linear`` dequantizes it a tile at a time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeVar

import numpy as np

if TYPE_CHECKING:
    from pocketllm.checkpoint import CheckpointTensor

GROUP_SIZE = 32
INT4_TYPES = {"Q4_0": 2, "Q4_1": 4}  # storage type -> header bytes (fp16 scale, and Q4_1's fp16 offset)
# Q4_K's 256-weight blocks are 8 affine groups of 32 (scale d * sc, offset -dmin * m): read as 4-bit groups where
# the Triton kernels take them (the native CPU kernels take Q4_0/Q4_1's groups only).
K_QUANT_INT4_TYPES = {"Q4_K"}
INT8_TYPES = {"Q8_0": 2}

G = TypeVar("G", bound="GroupedMatrix")


class GroupedMatrix:
    """What the group formats share: dataclasses of codes [rows, cols] and per-group arrays [rows, cols // 32],
    every field with rows first."""

    __slots__ = ()
    codes: np.ndarray

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # type: ignore[return-value]

    def map_rows(self: G, fn: Callable[[np.ndarray], np.ndarray]) -> G:
        """Apply the same row reordering (a function of the leading axis only) to every field."""
        return type(self)(*(fn(getattr(self, f.name)) for f in fields(self)))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class Int4Groups(GroupedMatrix):
    """``w[r, c] = scale[r, c // 32] * codes[r, c] + offset[r, c // 32]``; rows are output features."""

    codes: np.ndarray  # uint8 [rows, cols], each in [0, 15]
    scale: np.ndarray  # float32 [rows, cols // 32]
    offset: np.ndarray  # float32 [rows, cols // 32]


@dataclass(frozen=True, slots=True)
class Int8Groups(GroupedMatrix):
    """``w[r, c] = scale[r, c // 32] * codes[r, c]``; rows are output features."""

    codes: np.ndarray  # int8 [rows, cols]
    scale: np.ndarray  # float32 [rows, cols // 32]


@dataclass(frozen=True, slots=True)
class Fp8Groups(GroupedMatrix):
    """``w[r, c] = e4m3(codes[r, c]) * scale[r, c // 32]``; rows are output features."""

    codes: np.ndarray  # uint8 [rows, cols]: E4M3 bytes
    scale: np.ndarray  # float32 [rows, cols // 32]


Groups = Int4Groups | Int8Groups | Fp8Groups


@dataclass(frozen=True, slots=True)
class GroupFormats:
    """Which GGUF matrices a model's linear layers take as groups (``linear.group_formats`` says, per device)."""

    int4: bool  # Q4_0, Q4_1
    int8: bool  # Q8_0
    k_quants: bool = False  # Q4_K too, as 4-bit groups (where int4)


def load(tensor: CheckpointTensor, formats: GroupFormats) -> np.ndarray | Groups:
    """``tensor`` as 4- or 8-bit groups where the file stores a matrix so and ``formats`` wants them, as FP8 groups
    where it is FP8 (always: never dequantized at load unless its blocks do not fall on groups), else dequantized.

    Groups are unpacked from the raw blocks, with the reader's row permutation undone on every field."""
    if len(tensor.shape) == 2 and tensor.shape[1] % GROUP_SIZE == 0:
        blocks = np.frombuffer(tensor.data, dtype=np.uint8)
        groups: Int4Groups | Int8Groups | Fp8Groups | None = None
        scale = tensor.fp8_scale
        if scale is not None and scale.fits_groups(tensor.shape[1], GROUP_SIZE):
            groups = Fp8Groups(blocks.reshape(tensor.shape), scale.per_group(*tensor.shape, GROUP_SIZE))
        elif formats.int4 and tensor.storage_type in INT4_TYPES:
            groups = int4_from_blocks(blocks, tensor.storage_type, *tensor.shape)
        elif formats.int4 and formats.k_quants and tensor.storage_type in K_QUANT_INT4_TYPES:
            groups = int4_from_q4_k(blocks, *tensor.shape)
        elif formats.int8 and tensor.storage_type in INT8_TYPES:
            groups = int8_from_blocks(blocks, *tensor.shape)
        if groups is not None:
            permutation = tensor.row_permutation
            return groups if permutation is None else groups.map_rows(permutation.undo)
    return tensor.dequantize()


def int4_from_blocks(blocks: np.ndarray, storage_type: str, rows: int, cols: int) -> Int4Groups:
    """Unpack the raw bytes of a Q4_0/Q4_1 matrix of ``rows`` x ``cols`` (GGUF order: a row's blocks in turn)."""
    header = INT4_TYPES[storage_type]
    blocks = blocks.reshape(rows * cols // GROUP_SIZE, header + GROUP_SIZE // 2)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    offset = blocks[:, 2:4].copy().view(np.float16).astype(np.float32) if header == 4 else -8 * scale
    packed = blocks[:, header:]
    # Byte j of a block holds element j in its low nibble and element j + 16 in its high nibble.
    codes = np.concatenate((packed & 0x0F, packed >> 4), axis=1)
    groups = cols // GROUP_SIZE
    return Int4Groups(codes.reshape(rows, cols), scale.reshape(rows, groups), offset.reshape(rows, groups))


def int4_from_q4_k(blocks: np.ndarray, rows: int, cols: int) -> Int4Groups:
    """Unpack the raw bytes of a Q4_K matrix (``cols`` a multiple of 256): ``w = d * sc * q - dmin * m`` per group
    of 32, as gguf's dequantizer computes it (the products d * sc and dmin * m are exact in float32)."""
    from gguf.quants import Q4_K

    blocks = blocks.reshape(rows * cols // 256, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    # 32 bytes hold groups 2i (low nibbles) and 2i + 1 (high nibbles), byte t being weight t of each.
    packed = blocks[:, 16:].reshape(-1, 4, 1, 32)
    codes = (packed >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & np.uint8(0x0F)
    groups = cols // GROUP_SIZE
    scale = (d * sc.astype(np.float32)).reshape(rows, groups)
    offset = -(dmin * m.astype(np.float32)).reshape(rows, groups)
    return Int4Groups(codes.reshape(rows, cols), scale, offset)


def int8_from_blocks(blocks: np.ndarray, rows: int, cols: int) -> Int8Groups:
    """Unpack the raw bytes of a Q8_0 matrix of ``rows`` x ``cols`` (GGUF order: a row's blocks in turn)."""
    blocks = blocks.reshape(rows * cols // GROUP_SIZE, 2 + GROUP_SIZE)
    scale = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    codes = blocks[:, 2:].copy().view(np.int8)
    return Int8Groups(codes.reshape(rows, cols), scale.reshape(rows, cols // GROUP_SIZE))
