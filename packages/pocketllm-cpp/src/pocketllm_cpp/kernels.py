"""Matrix products over GGUF blocks read in place, with 8-bit activations; the compute releases the GIL.

``matmul(tensor, x)`` takes a :class:`pocketllm.checkpoint.CheckpointTensor` (its raw bytes: a zero-copy view of
the memory-mapped file, no dequantized copy) or raw bytes with a type and shape. ``moe_forward`` is a
mixture-of-experts block (softmax top-k routing, SwiGLU experts, a shared expert) over :class:`Tensor` s, which
``tensor_of`` makes from checkpoint tensors (a GGUF's stacked ``ffn_*_exps`` read in place).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pocketllm_cpp import _native

if TYPE_CHECKING:
    from pocketllm.checkpoint import CheckpointTensor

isa, best_isa, set_isa, num_threads = _native.isa, _native.best_isa, _native.set_isa, _native.num_threads
available_isas = _native.available_isas
quantize_activations = _native.quantize_activations
Tensor, moe_forward = _native.Tensor, _native.moe_forward


def raw(tensor: CheckpointTensor) -> tuple[np.ndarray, str, int, int]:
    """A 2-D tensor's bytes, storage type and [rows, cols], as the kernels take them."""
    if len(tensor.shape) != 2:
        raise ValueError(f"tensor {tensor.name!r} has shape {tensor.shape}; the kernels take matrices")
    if tensor.row_permutation is not None:
        raise ValueError(f"tensor {tensor.name!r} has permuted rows; un-permute the output rows or the tensor")
    return np.frombuffer(tensor.data, dtype=np.uint8), tensor.storage_type, *tensor.shape


def scales(tensor: CheckpointTensor) -> np.ndarray | None:
    """An F8_E4M3 matrix's scales as the kernels take them: one per 32 columns of each row."""
    if tensor.fp8_scale is None:
        return None
    rows, cols = tensor.shape
    return tensor.fp8_scale.per_group(rows, cols, 32).reshape(-1)


def matmul(tensor: CheckpointTensor, x: np.ndarray) -> np.ndarray:
    """``x @ W.T`` for float32 ``x`` [n, cols]."""
    return _native.matmul(*raw(tensor), np.ascontiguousarray(x, dtype=np.float32), scales=scales(tensor))


def dequantize(tensor: CheckpointTensor) -> np.ndarray:
    return _native.dequantize(*raw(tensor), scales=scales(tensor))


def tensor_of(tensor: CheckpointTensor) -> Tensor:
    """A tensor as ``moe_forward`` takes it: its bytes in place, storage type and shape (stacked experts first)."""
    if tensor.row_permutation is not None:
        raise ValueError(f"tensor {tensor.name!r} has permuted rows; the MoE block takes them as stored")
    return Tensor(np.frombuffer(tensor.data, dtype=np.uint8), tensor.storage_type, list(tensor.shape))
