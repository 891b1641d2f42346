"""What every architecture's loader shares: the build options, and the checkpoint's tensors as the native
module reads them (matrices in their file bytes where the kernels read that storage type, vectors as float32)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import numpy as np

from pocketllm.errors import CheckpointError, UnsupportedOptionError
from pocketllm_cpp import _native
from pocketllm_cpp.name import NAME

if TYPE_CHECKING:
    from collections.abc import Iterable
    from pathlib import Path

    from pocketllm.checkpoint import CheckpointTensor

STORAGE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL",
                 "MXFP4", "IQ4_XS", "Q2_K", "Q3_K", "F8_E4M3")  # read in place
ROW_MULTIPLE = 32


class BuildOptions(msgspec.Struct, frozen=True, kw_only=True):
    num_blocks: int
    block_size: int
    num_threads: int
    exact_activations: bool
    kv_cache_dtype: str
    num_state_slots: int  # requests that may run at once: the fixed-size state slots of hybrid models
    mtp: bool = False  # with the multi-token-prediction head (speculative_method "mtp")


class Tensors:
    """A checkpoint's tensors by name; a missing one is a CheckpointError naming the file."""

    def __init__(self, path: Path | str, tensors: Iterable[CheckpointTensor]) -> None:
        self.path = path
        self.by_name = {t.name: t for t in tensors}
        self.taken: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.by_name

    def take(self, name: str) -> CheckpointTensor:
        if name not in self.by_name:
            raise CheckpointError(f"{self.path}: checkpoint has no tensor {name!r}")
        self.taken.add(name)
        return self.by_name[name]

    def finish(self) -> None:
        """CheckpointError for tensors nothing took: a part the reader does not know would be silently unused."""
        unused = sorted(set(self.by_name) - self.taken)
        if unused:
            raise CheckpointError(f"{self.path}: tensors this model does not use: {unused[:5]}")

    def matrix(self, name: str) -> _native.Tensor:
        tensor = self.take(name)
        if len(tensor.shape) != 2:
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {list(tensor.shape)}, expected a matrix")
        return tensor_of(tensor)


def tensor_of(tensor: CheckpointTensor) -> _native.Tensor:
    """A matrix or stacked matrices as the kernels read them: the file's bytes where they can read its storage type,
    else a float32 copy. Rows must divide into the 32-value blocks the kernels quantize activations in: every
    released model's do; the torch backend serves a checkpoint whose rows do not."""
    width = tensor.shape[-1]
    if width % ROW_MULTIPLE:
        raise UnsupportedOptionError("model", NAME, f"tensor {tensor.name!r} has rows of {width} values, not a "
                                                    f"multiple of {ROW_MULTIPLE}")
    scale = tensor.fp8_scale
    if scale is not None and scale.fits_groups(width, ROW_MULTIPLE):  # the kernels take a scale per 32 columns
        scales = scale.per_group(tensor.shape[0], width, ROW_MULTIPLE).reshape(-1)
        return _native.Tensor(np.frombuffer(tensor.data, dtype=np.uint8), tensor.storage_type, list(tensor.shape),
                              scales)
    if tensor.storage_type in STORAGE_TYPES and scale is None:
        return _native.Tensor(np.frombuffer(tensor.data, dtype=np.uint8), tensor.storage_type, list(tensor.shape))
    if tensor.row_permutation is not None:  # dequantize() undid it; the kernels expect the file's order
        raise UnsupportedOptionError("quantization", NAME, f"{tensor.storage_type} q/k matrices of a permuted GGUF")
    dense = np.ascontiguousarray(tensor.dequantize(), dtype=np.float32)
    return _native.Tensor(dense.view(np.uint8).reshape(-1), "F32", list(tensor.shape))


def vector(tensor: CheckpointTensor) -> np.ndarray:
    return np.ascontiguousarray(tensor.dequantize(), dtype=np.float32).reshape(-1)
