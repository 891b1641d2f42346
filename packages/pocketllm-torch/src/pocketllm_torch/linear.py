"""Linear layers, each keeping its weight in the layout that is fastest for the device, dtype and batch size.

On CPUs, decode is bound by the bytes of weight streamed per step; prefill and batched decode by arithmetic.
Stock ``F.linear`` is good at neither on every CPU: MKL's fp32 GEMM is slow for the few rows of a decode
batch, and without bf16 matrix instructions (AVX512-BF16, AMX) torch's bf16 GEMM is slow beyond one row.
Matrices a GGUF file stores in 4-bit groups (Q4_0/Q4_1) stay 4-bit: the native kernel (``native.py``) takes
float32 activations and serves every batch, prefill included, or else torch's int4 kernel takes bf16 ones for
decode and small batches, beside a dense copy for larger ones; both read a quarter of the bytes of bf16 and compute
exactly the groups' affine form. 8-bit groups (Q8_0) stay 8-bit where the native kernels are built.

A sequence's numbers must not depend on what else is in its step, or a seeded request would sample other tokens
on a busy server than alone. The native kernels compute each row alike whatever the batch; a kernel that changes
with the number of rows (a dense copy beyond a few rows, a bf16 GEMV for one) breaks that, so the native kernel has
no dense copy. torch's GEMMs, which the remaining layers use, vary in the last bits with the row count.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from pocketllm_torch import native, triton_ops
from pocketllm_torch.groups import GROUP_SIZE, Fp8Groups, GroupFormats, Int4Groups, Int8Groups

if TYPE_CHECKING:
    from collections.abc import Callable

# Rows up to which the bf16 GEMV of a weight beats the fp32 oneDNN GEMM over twice its bytes.
BF16_GEMV_MAX_ROWS = 1
# Rows up to which torch's int4 CPU kernel beats the fp32 oneDNN GEMM (measured on AVX2: equal at 8, 2x slower at 64).
TORCH_INT4_MAX_ROWS = 8
# fp32 weights of up to this many elements stay plain F.linear: oneDNN's fixed cost per call (30-50 us measured on
# Zen 3 and Zen 5) exceeds a whole GEMM this small at 1 to 8 rows (512 x 256: 26 vs 52 us at one row, equal at
# eight; 128 x 128: 8 vs 46 us), so tiny-width models (tests', the bench's hybrid) would be bound by it.
SMALL_WEIGHT_ELEMENTS = 1 << 17
# Output rows of an FP8 weight dequantized at a time: 256 rows of a 4096-wide matrix are 4 MiB of float32.
FP8_TILE_ROWS = 256


class Linear(Protocol):
    """A linear layer; its choice of kernel may depend on the number of rows only through ``kernel_key``."""

    def __call__(self, x: Tensor) -> Tensor: ...


def kernel_key(rows: int) -> tuple[bool, ...]:
    """What every linear layer's choice of kernel depends on, for an input of ``rows`` rows."""
    return rows <= BF16_GEMV_MAX_ROWS, rows <= TORCH_INT4_MAX_ROWS


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


@dataclass(slots=True)
class Int4Weight:
    """``w = scale * codes + offset`` per group of 32 inputs (see ``pocketllm_torch.groups``), as tensors."""

    codes: Tensor  # uint8 [out, in]
    scale: Tensor  # float32 [out, in / 32]
    offset: Tensor

    @classmethod
    def from_groups(cls, groups: Int4Groups) -> Int4Weight:
        return cls(*(torch.from_numpy(a) for a in (groups.codes, groups.scale, groups.offset)))

    def dequantize(self) -> Tensor:
        """float32 [out, in]: code * scale, then + offset, in float32 (as gguf's dequantizer computes it), in
        torch's threaded kernels, one pass each: dense copies for prefill are most of a load's work."""
        out, cols = self.codes.shape
        w = self.codes.view(out, cols // GROUP_SIZE, GROUP_SIZE).to(torch.float32)
        return w.mul_(self.scale.unsqueeze(-1)).add_(self.offset.unsqueeze(-1)).view(out, cols)


@dataclass(slots=True)
class Int8Weight:
    """``w = scale * codes`` per group of 32 inputs (see ``pocketllm_torch.groups``), as tensors."""

    codes: Tensor  # int8 [out, in]
    scale: Tensor  # float32 [out, in / 32]

    @classmethod
    def from_groups(cls, groups: Int8Groups) -> Int8Weight:
        return cls(torch.from_numpy(groups.codes), torch.from_numpy(groups.scale))

    def dequantize(self) -> Tensor:
        """float32 [out, in]: code * scale in float32, in torch's threaded kernels."""
        out, cols = self.codes.shape
        w = self.codes.view(out, cols // GROUP_SIZE, GROUP_SIZE).to(torch.float32)
        return w.mul_(self.scale.unsqueeze(-1)).view(out, cols)


@dataclass(slots=True)
class Fp8Weight:
    """``w = e4m3(codes) * scale`` per group of 32 inputs (see ``pocketllm_torch.groups.Fp8Groups``), as tensors."""

    codes: Tensor  # uint8 [out, in]: E4M3 bytes
    scale: Tensor  # float32 [out, in / 32]

    @classmethod
    def from_groups(cls, groups: Fp8Groups) -> Fp8Weight:
        return cls(torch.from_numpy(np.array(groups.codes)), torch.from_numpy(groups.scale))  # off the read-only map

    def dequantize(self, begin: int = 0, end: int | None = None) -> Tensor:
        """float32 [end - begin, in] of output rows [begin, end): fp8 * scale in float32, as the checkpoint
        reader's reference computes it."""
        codes = self.codes[begin:end]
        rows, cols = codes.shape
        w = codes.view(torch.float8_e4m3fn).to(torch.float32).view(rows, cols // GROUP_SIZE, GROUP_SIZE)
        return w.mul_(self.scale[begin:end].unsqueeze(-1)).view(rows, cols)


GroupedWeight = TypeVar("GroupedWeight", Int4Weight, Int8Weight, Fp8Weight)


def astuple(weight: Int4Weight | Int8Weight | Fp8Weight) -> tuple[Tensor, ...]:
    """The weight's tensors, each with output features first (unlike dataclasses.astuple, without copies)."""
    return tuple(getattr(weight, f.name) for f in fields(weight))


def map_rows(weight: GroupedWeight, fn: Callable[[Tensor], Tensor]) -> GroupedWeight:
    """Apply the same reordering of output features (a function of the leading axis only) to every tensor."""
    return type(weight)(*map(fn, astuple(weight)))


AnyWeight = Tensor | Int4Weight | Int8Weight | Fp8Weight


def concat_rows(parts: list[AnyWeight]) -> AnyWeight:
    """Stack weights along output features (q/k/v, gate/up); grouped only if every part has the same format."""
    kind = type(parts[0])
    if kind is not Tensor and all(type(p) is kind for p in parts):
        return kind(*(torch.cat(t) for t in zip(*map(astuple, parts), strict=True)))
    return torch.cat([p if isinstance(p, Tensor) else p.dequantize() for p in parts])


@dataclass(slots=True)
class NativeGrouped:
    """A native kernel (``native.int4_linear`` or ``int8_linear``): float32 activations, packed weights, any
    number of rows."""

    op: Callable[[Tensor, Tensor, int], Tensor]
    packed: Tensor
    out_features: int
    max_rows = math.inf

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        y = self.op(x.float(), self.packed, native.packed_outputs(self.packed))
        if y.shape[1] != self.out_features:  # outputs padded to whole blocks (a vocabulary, say) are cut off
            y = y[:, :self.out_features].contiguous()
        return y.to(out_dtype or x.dtype)


@dataclass(slots=True)
class TorchInt4:
    """torch's int4 CPU kernel (a private op): bf16 activations, bf16 ``(codes - 8) * scale + zero``.

    Its bf16 output is kept: the next op converts it only where it must (as ``SplitBF16Linear``'s does).
    """

    packed: Tensor
    scale_zero: Tensor  # [in / 32, out, 2] bf16
    max_rows = TORCH_INT4_MAX_ROWS

    def __call__(self, x: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scale_zero)
        return y if out_dtype is None else y.to(out_dtype)


@dataclass(slots=True)
class GroupedLinear:
    """Weights kept in 4- or 8-bit groups, and for torch's int4 kernel a dense copy for more rows than it takes."""

    kernel: NativeGrouped | TorchInt4
    bias: Tensor | None
    dense: Linear | None
    # The outputs' dtype; None: the kernel's. float32 keeps what the native kernel computes where bf16 would round
    # it: logits, and partial sums that tensor-parallel ranks add up.
    out_dtype: torch.dtype | None = None

    def __call__(self, x: Tensor) -> Tensor:
        if self.dense is not None and x.shape[0] > self.kernel.max_rows:
            y = self.dense(x)
            return y if self.out_dtype is None else y.to(self.out_dtype)
        y = self.kernel(x, self.out_dtype)
        return y if self.bias is None else y.add_(self.bias)


@dataclass(slots=True)
class Fp8Linear:
    """FP8 weights dequantized a tile of output rows at a time, each tile multiplied as soon as it is made: the
    weights stay one byte per value, and only one tile's dense copy exists at a time."""

    weight: Fp8Weight
    bias: Tensor | None
    dtype: torch.dtype  # of the dequantized tiles, and so of the product

    def __call__(self, x: Tensor) -> Tensor:
        rows = len(self.weight.codes)
        x = x.to(self.dtype)
        y = x.new_empty(x.shape[0], rows)
        for begin in range(0, rows, FP8_TILE_ROWS):
            end = min(begin + FP8_TILE_ROWS, rows)
            y[:, begin:end] = F.linear(x, self.weight.dequantize(begin, end).to(self.dtype))
        return y if self.bias is None else y.add_(self.bias)


@dataclass(slots=True)
class TritonGroupedLinear:
    """GGUF's 4- and 8-bit groups where the Triton kernels run (a GPU): the grouped GEMM dequantizes a tile of
    groups at a time, so the weights keep their 4 or 8 bits (4-bit codes two to a byte) plus a scale (and an offset)
    per 32. While a decode trace records (torch ops only) the same weights are dequantized for F.linear."""

    codes: Tensor  # 4-bit: triton_ops.pack_int4's bytes [out, in / 2]; 8-bit: int8 [out, in]
    scale: Tensor  # float32 [out, in / 32]
    offset: Tensor | None  # float32 [out, in / 32] for 4-bit codes
    bias: Tensor | None
    out_dtype: torch.dtype | None

    @classmethod
    def build(cls, weight: Int4Weight | Int8Weight, bias: Tensor | None, device: torch.device,
              dtype: torch.dtype, out_dtype: torch.dtype | None) -> TritonGroupedLinear:
        if isinstance(weight, Int4Weight):
            codes, offset = triton_ops.pack_int4(weight.codes).to(device), weight.offset.to(device)
        else:
            codes, offset = weight.codes.to(device), None
        kernel_bias = None if bias is None else bias.to(device, out_dtype or dtype)
        return cls(codes, weight.scale.to(device), offset, kernel_bias, out_dtype)

    def dequantize(self) -> Tensor:
        """float32 [out, in], as Int4Weight/Int8Weight.dequantize computes it."""
        out, groups = self.scale.shape
        if self.offset is None:
            w = self.codes.view(out, groups, GROUP_SIZE).to(torch.float32)
            return w.mul_(self.scale.unsqueeze(-1)).view(out, -1)
        packed = self.codes.view(out, groups, 1, GROUP_SIZE // 2)
        codes = torch.cat((packed & 15, packed >> 4), dim=2).to(torch.float32)  # weights 0-15, then 16-31
        return codes.mul_(self.scale[:, :, None, None]).add_(self.offset[:, :, None, None]).view(out, -1)

    def __call__(self, x: Tensor) -> Tensor:
        if triton_ops.use_triton(x):
            y = triton_ops.grouped_matmul(x, self.codes, self.scale, self.offset, self.out_dtype)
        else:
            y = F.linear(x, self.dequantize().to(x.dtype)).to(self.out_dtype or x.dtype)
        return y if self.bias is None else y.add_(self.bias)


def group_formats(device: torch.device, dtype: torch.dtype) -> GroupFormats:
    """Which GGUF matrices stay in their groups on ``device``: all of the Triton GEMM's where it runs, else what
    the CPU kernels take."""
    if triton_ops.keeps_groups(device):
        return GroupFormats(int4=True, int8=True, k_quants=True)
    return GroupFormats(int4=uses_int4(device, dtype), int8=uses_int8(device))


def uses_int4(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether 4-bit GGUF matrices are worth keeping 4-bit: with the native kernel, or torch's with bf16 inputs."""
    return device.type == "cpu" and (native.enabled() or (dtype == torch.bfloat16 and _int4_available()))


def uses_int8(device: torch.device) -> bool:
    """Whether 8-bit GGUF matrices are kept 8-bit: with the native kernel only."""
    return device.type == "cpu" and native.enabled()


def compute_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype of activations: fp32 where bf16 weights go through fp32 kernels."""
    return torch.float32 if _split_bf16(device, dtype) else dtype


def make_linear(weight: AnyWeight, bias: Tensor | None, device: torch.device,
                dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> Linear:
    """Build a linear layer from a weight of shape [out_features, in_features]: any float dtype, or groups.

    ``out_dtype`` float32: the 4- and 8-bit kernels' outputs stay float32 (see GroupedLinear.out_dtype); the
    other layers' outputs are their kernels' (the caller converts them)."""
    if isinstance(weight, Fp8Weight):
        tiles = out_dtype or compute_dtype(device, dtype)
        weight = Fp8Weight(weight.codes.to(device), weight.scale.to(device))
        return Fp8Linear(weight, None if bias is None else bias.to(device, tiles), tiles)
    if isinstance(weight, (Int4Weight, Int8Weight)) and triton_ops.keeps_groups(device):
        return TritonGroupedLinear.build(weight, bias, device, dtype, out_dtype)
    if isinstance(weight, Int8Weight):
        if not (uses_int8(device) and native.packs(weight.codes.shape)):
            return make_linear(weight.dequantize(), bias, device, dtype)
        kernel = NativeGrouped(native.int8_linear, native.pack_int8(*astuple(weight)), len(weight.codes))
        return GroupedLinear(kernel, None if bias is None else bias.to(compute_dtype(device, dtype)), None, out_dtype)
    if isinstance(weight, Int4Weight):
        if not (uses_int4(device, dtype) and native.packs(weight.codes.shape)
                and (native.enabled() or len(weight.codes) % native.BLOCK_OUT == 0)):  # torch's takes whole blocks
            return make_linear(weight.dequantize(), bias, device, dtype)
        kernel_bias = None if bias is None else bias.to(compute_dtype(device, dtype))
        if native.enabled():
            kernel = NativeGrouped(native.int4_linear, native.pack_int4(*astuple(weight)), len(weight.codes))
            return GroupedLinear(kernel, kernel_bias, None, out_dtype)
        # torch's kernel takes few rows. The dense copy is exact in fp32 where bf16 GEMM is slow, else it is what
        # plain bf16 would use anyway.
        dense = make_linear(weight.dequantize(), bias, device, compute_dtype(device, dtype))
        return GroupedLinear(_torch_int4(weight), kernel_bias, dense, out_dtype)
    if _split_bf16(device, dtype):
        weight = weight.to(torch.bfloat16)
        packed_bias = None if bias is None else bias.to(torch.bfloat16).float()
        packed = PackedLinear(_pack(weight.float()), packed_bias)
        return SplitBF16Linear(weight, None if bias is None else bias.to(torch.bfloat16), packed)
    small = weight.numel() <= SMALL_WEIGHT_ELEMENTS
    if device.type == "cpu" and dtype == torch.float32 and not small and _onednn_available():
        return PackedLinear(_pack(weight.float()), None if bias is None else bias.float())
    weight = weight.to(device, dtype)
    return DenseLinear(weight, None if bias is None else bias.to(device, dtype))


def _torch_int4(weight: Int4Weight) -> TorchInt4:
    zero = weight.offset + 8 * weight.scale
    scale_zero = torch.stack((weight.scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return TorchInt4(torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1), scale_zero)


def _split_bf16(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and _onednn_available()
            and not torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _pack(weight: Tensor) -> Tensor:
    # The batch-size hint only tunes the layout; any number of rows works afterwards.
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 8)


@functools.cache
def _int4_available() -> bool:
    """Whether this torch build has the int4 CPU kernel (a private op): try it rather than trust it."""
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.full((16, 32), 9, dtype=torch.int32), 1)
        scale_zero = torch.ones(1, 16, 2, dtype=torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.ones(1, 32, dtype=torch.bfloat16), packed, 32, scale_zero)
    except (RuntimeError, AttributeError):
        return False
    return bool(y.eq(64).all())  # 32 inputs x ((9 - 8) * 1 + 1)


@functools.cache
def _onednn_available() -> bool:
    """Whether oneDNN's prepacked linear works here: it is a private torch op, so try it rather than trust it."""
    try:
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 2), _pack(torch.ones(2, 2)), None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(y.eq(2).all())
