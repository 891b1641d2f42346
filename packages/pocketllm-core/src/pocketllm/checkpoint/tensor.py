"""One tensor of a checkpoint, described without being read: what every backend reads its own way.

A backend with its own kernels takes the raw bytes (``data``, or ``path`` + ``offset`` to map the file itself)
in their storage type; any backend can ask for ``dequantize()`` instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from pocketllm.checkpoint import fp8
from pocketllm.checkpoint.fp8 import Fp8Scale
from pocketllm.errors import CheckpointError


@dataclass(frozen=True, slots=True)
class RowPermutation:
    """llama.cpp's converter stores the rows of each q/k head of a Llama model reordered for its RoPE kernel
    (``LlamaModel.permute``): within each of ``num_heads`` heads, the row pairs (i, i + D/2) of Hugging Face's
    layout become adjacent rows (2i, 2i + 1). A backend that reads raw blocks gets those file rows and this
    description; ``dequantize()`` undoes it."""

    num_heads: int

    def undo(self, rows: np.ndarray) -> np.ndarray:
        """File row order -> Hugging Face row order, along the leading axis (any trailing axes ride along)."""
        half = rows.shape[0] // self.num_heads // 2
        return rows.reshape(self.num_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@dataclass(frozen=True, slots=True)
class CheckpointTensor:
    """A tensor in Hugging Face naming and layout, not read until asked.

    ``shape`` is row-major as in the Hugging Face checkpoint (``[out_features, in_features]`` for a linear
    weight; stacked experts lead with the expert axis). ``storage_type`` is how its values are stored: "F32",
    "F16", "BF16", "F64", "F8_E4M3" (with ``fp8_scale``), or a GGML quantized storage type such as "Q8_0", "Q4_0",
    "Q4_1", "Q4_K", "Q5_K", "Q6_K".
    The bytes are ``nbytes`` long at ``offset`` in the file at ``path``; a quantized storage type stores each row's
    blocks (of 32 or 256 values) in turn.
    """

    name: str
    file_name: str  # the name in the file (GGUF's "blk.0.attn_q.weight", or the same as ``name``)
    shape: tuple[int, ...]
    storage_type: str
    path: Path
    offset: int
    nbytes: int
    row_permutation: RowPermutation | None = None
    fp8_scale: Fp8Scale | None = field(default=None, compare=False)  # an F8_E4M3 matrix's scales (checkpoint.fp8)
    _buffer: np.ndarray = field(repr=False, compare=False, default=None)  # type: ignore[assignment]

    @property
    def data(self) -> memoryview:
        """The raw bytes: a read-only, zero-copy view of the memory-mapped file."""
        view = memoryview(self._buffer)
        return view.toreadonly() if not view.readonly else view

    def dequantize(self) -> np.ndarray:
        """The values as float32 in Hugging Face layout (float16 tensors stay float16). Read-only: copy it
        before writing to it."""
        raw = self._buffer
        try:
            if self.storage_type in ("F32", "F16", "F64"):
                array = raw.view({"F32": np.float32, "F16": np.float16, "F64": np.float64}[self.storage_type])
                array = array.astype(np.float32) if self.storage_type == "F64" else array
            elif self.storage_type == "BF16":
                array = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif self.storage_type == fp8.FP8:
                if self.fp8_scale is None:
                    raise ValueError("it has no scales")
                array = fp8.dequantize(raw, self.shape, self.fp8_scale)
            else:
                array = gguf.quants.dequantize(raw.reshape(-1, self.nbytes // _rows(self.shape)),
                                               gguf.GGMLQuantizationType[self.storage_type])
        except (NotImplementedError, KeyError, ValueError) as e:
            raise CheckpointError(f"{self.path}: tensor {self.file_name!r} ({self.storage_type}): cannot dequantize: "
                                  f"{e}") from None
        array = array.reshape(self.shape)
        return array if self.row_permutation is None else self.row_permutation.undo(array)


def _rows(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape[:-1])) if len(shape) > 1 else 1
