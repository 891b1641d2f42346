"""Linear layers, each keeping its weight in the layout that is fastest for the device, dtype and batch size.

On CPUs, decode is bound by the bytes of weight streamed per step; prefill and batched decode by arithmetic.
Stock ``F.linear`` is good at neither on every CPU: MKL's fp32 GEMM is slow for the few rows of a decode
batch, and without bf16 matrix instructions (AVX512-BF16, AMX) torch's bf16 GEMM is slow beyond one row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

# Rows up to which the bf16 GEMV of a weight beats the fp32 oneDNN GEMM over twice its bytes.
BF16_GEMV_MAX_ROWS = 1


class Linear(Protocol):
    def __call__(self, x: Tensor) -> Tensor: ...


@dataclass(slots=True)
class DenseLinear:
    weight: Tensor
    bias: Tensor | None

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(slots=True)
class PackedLinear:
    """fp32 weight reordered once into oneDNN's blocked layout, which is fast at every batch size."""

    packed: Tensor
    bias: Tensor | None

    def __call__(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@dataclass(slots=True)
class SplitBF16Linear:
    """bf16 weights on a CPU without bf16 matrix instructions; activations stay fp32.

    Single rows use torch's bf16 GEMV, which streams half the bytes of fp32; larger batches use an fp32 oneDNN
    copy of the same bf16-rounded weights, trading memory for the speed bf16 GEMM lacks on such CPUs. The output
    keeps the kernel's dtype: a bf16 row feeding the next bf16 GEMV (gate/up into down) then converts nothing.
    """

    weight: Tensor
    bias: Tensor | None
    packed: PackedLinear

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[0] <= BF16_GEMV_MAX_ROWS:
            return F.linear(x.to(torch.bfloat16), self.weight, self.bias)
        return self.packed(x)


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype of activations: fp32 where bf16 weights go through fp32 kernels."""
    return torch.float32 if _split_bf16(device, dtype) else dtype


def make_linear(weight: Tensor, bias: Tensor | None, device: torch.device, dtype: torch.dtype) -> Linear:
    """Build a linear layer from a weight of shape [out_features, in_features] in any float dtype."""
    if _split_bf16(device, dtype):
        weight = weight.to(torch.bfloat16)
        packed_bias = None if bias is None else bias.to(torch.bfloat16).float()
        packed = PackedLinear(_pack(weight.float()), packed_bias)
        return SplitBF16Linear(weight, None if bias is None else bias.to(torch.bfloat16), packed)
    if device.type == "cpu" and dtype == torch.float32 and _onednn_available():
        return PackedLinear(_pack(weight.float()), None if bias is None else bias.float())
    weight = weight.to(device, dtype)
    return DenseLinear(weight, None if bias is None else bias.to(device, dtype))


def _split_bf16(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and _onednn_available()
            and not torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _pack(weight: Tensor) -> Tensor:
    # The batch-size hint only tunes the layout; any number of rows works afterwards.
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 8)


@functools.cache
def _onednn_available() -> bool:
    """Whether oneDNN's prepacked linear works here: it is a private torch op, so try it rather than trust it."""
    try:
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), _pack(torch.ones(2, 2)), None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(y.eq(2).all())
