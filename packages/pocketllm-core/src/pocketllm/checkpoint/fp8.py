"""FP8 (E4M3) weights as published safetensors checkpoints store them.

A quantized linear weight ``X.weight`` is stored as ``F8_E4M3`` beside its float scales, and its value is
``fp8 * scale`` (the scale multiplies, whatever its name):

- ``X.weight_scale_inv``, one scale per block of ``weight_block_size`` (``[128, 128]``) rows x columns, as
  DeepSeek's and Qwen's FP8 releases store them (``quantization_config.quant_method: "fp8"``);
- ``X.weight_scale``, one scale per tensor (``[]`` or ``[1]``) or per output channel (``[rows, 1]`` or
  ``[rows]``), as llm-compressor's FP8 checkpoints (``"compressed-tensors"``, ``float-quantized``) and vLLM's
  per-tensor ``"fp8"`` checkpoints store them.

Activations are computed in the backend's own precision: a checkpoint with static activation scales
(``input_scale``, ``activation_scheme: "static"``) asks for FP8 activations, which no backend computes, so it is
refused rather than served with those scales ignored.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from pocketllm.errors import CheckpointError

if TYPE_CHECKING:
    from pocketllm.checkpoint.tensor import CheckpointTensor

FP8 = "F8_E4M3"
BLOCK_SCALE, CHANNEL_SCALE = ".weight_scale_inv", ".weight_scale"
METHODS = ("fp8", "compressed-tensors")
MAX_SCALE = 2.0 ** 100


@dataclass(frozen=True, slots=True)
class Fp8Scale:
    """The scales of one FP8 matrix: ``values[i, j]`` multiplies rows ``[i * block[0], (i + 1) * block[0])`` and
    columns ``[j * block[1], (j + 1) * block[1])`` (the last block of each axis may be partial)."""

    values: np.ndarray  # float32 [ceil(rows / block[0]), ceil(cols / block[1])]
    block: tuple[int, int]

    def fits_groups(self, cols: int, group: int) -> bool:
        """Whether each ``group`` columns share one scale (per_group's condition)."""
        return cols % group == 0 and (self.block[1] % group == 0 or self.block[1] >= cols)

    def per_group(self, rows: int, cols: int, group: int) -> np.ndarray:
        """float32 [rows, cols / group]: the scale of each ``group`` columns of each row (see fits_groups)."""
        if not self.fits_groups(cols, group):
            raise ValueError(f"blocks of {self.block[1]} columns do not fall on groups of {group}")
        expanded = np.repeat(self.values, self.block[0], axis=0)[:rows]
        per_block = self.block[1] // group if self.block[1] < cols else -(-cols // group)
        return np.ascontiguousarray(np.repeat(expanded, per_block, axis=1)[:, :cols // group])


@functools.cache
def fp8_values() -> np.ndarray:
    """float32 value of each E4M3 byte (sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities; 0x7F and
    0xFF are NaN)."""
    codes = np.arange(256)
    sign = np.where(codes & 0x80, -1.0, 1.0)
    exponent, mantissa = (codes >> 3) & 0x0F, codes & 0x07
    magnitude = np.where(exponent == 0, mantissa / 8 * 2.0 ** -6, (1 + mantissa / 8) * 2.0 ** (exponent - 7))
    values = (sign * magnitude).astype(np.float32)
    values[[0x7F, 0xFF]] = np.nan
    return values


def dequantize(codes: np.ndarray, shape: tuple[int, ...], scale: Fp8Scale) -> np.ndarray:
    """float32 ``fp8 * scale`` of a matrix stored as E4M3 bytes."""
    rows, cols = shape
    values = fp8_values()[codes.reshape(rows, cols)]
    expanded = np.repeat(np.repeat(scale.values, scale.block[0], axis=0)[:rows], scale.block[1], axis=1)[:, :cols]
    return values * expanded


def attach_scales(tensors: list[CheckpointTensor], quantization: Any, source: str) -> list[CheckpointTensor]:
    """The tensors with each FP8 weight's scales attached (``CheckpointTensor.fp8_scale``) and the scale tensors
    themselves removed; CheckpointError for a method, layout or scale that cannot be served as it is meant."""
    block = _block_size(quantization, source)
    by_name = {t.name: t for t in tensors}
    scale_names = sorted(t.name for t in tensors if t.name.endswith((BLOCK_SCALE, CHANNEL_SCALE)))
    if static := [t.name for t in tensors if t.name.endswith(".input_scale")]:
        raise CheckpointError(f"{source}: static FP8 activation scales ({static[0]}, ...) are not supported: "
                              "activations are computed in the backend's precision (use a dynamic-activation "
                              "FP8 checkpoint)")
    out = []
    for t in tensors:
        if t.name.endswith((BLOCK_SCALE, CHANNEL_SCALE)):
            continue
        if t.storage_type != FP8:
            out.append(t)
            continue
        if not t.name.endswith(".weight") or len(t.shape) != 2:
            raise CheckpointError(f"{source}: tensor {t.name!r} is {FP8} {list(t.shape)}; only matrices "
                                  "('*.weight') may be")
        stem = t.name.removesuffix(".weight")
        if stem + BLOCK_SCALE in by_name:
            scale = _block_scale(t, by_name[stem + BLOCK_SCALE], block, source)
        elif stem + CHANNEL_SCALE in by_name:
            scale = _channel_scale(t, by_name[stem + CHANNEL_SCALE], block, source)
        else:
            raise CheckpointError(f"{source}: {FP8} tensor {t.name!r} has no {stem + BLOCK_SCALE!r} or "
                                  f"{stem + CHANNEL_SCALE!r}")
        out.append(replace(t, fp8_scale=scale))
    weights = (by_name.get(n.removesuffix(BLOCK_SCALE).removesuffix(CHANNEL_SCALE) + ".weight") for n in scale_names)
    if orphans := sorted(n for n, w in zip(scale_names, weights, strict=True) if w is None or w.storage_type != FP8):
        raise CheckpointError(f"{source}: scale tensors without an {FP8} weight: {orphans[:5]}")
    return out


def _block_size(quantization: Any, source: str) -> tuple[int, int] | None:
    """``weight_block_size`` of a quantization_config (None: scales per tensor or channel), checked."""
    if quantization is None:
        return None
    if not isinstance(quantization, Mapping):
        raise CheckpointError(f"{source}: 'quantization_config' must be an object")
    method = quantization.get("quant_method")
    if method not in METHODS:
        raise CheckpointError(f"{source}: quantization method {method!r} is not supported (supported: FP8 "
                              f"checkpoints, quant_method {' or '.join(map(repr, METHODS))})")
    if method == "compressed-tensors" and quantization.get("format") not in ("float-quantized", "naive-quantized"):
        raise CheckpointError(f"{source}: compressed-tensors format {quantization.get('format')!r} is not "
                              "supported (only FP8 weights: 'float-quantized')")
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{source}: FP8 format {quantization.get('fmt')!r} is not supported (only e4m3)")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{source}: FP8 activation_scheme {quantization.get('activation_scheme')!r} is not "
                              "supported (only 'dynamic')")
    block = quantization.get("weight_block_size")
    if method == "compressed-tensors":  # its block size is its weights' scheme's, per config group
        groups = quantization.get("config_groups")
        groups = list(groups.values()) if isinstance(groups, Mapping) else []
        schemes = [g.get("weights") for g in groups if isinstance(g, Mapping)]
        blocks = [w["block_structure"] for w in schemes if isinstance(w, Mapping) and w.get("block_structure")]
        if any(b != blocks[0] for b in blocks):
            raise CheckpointError(f"{source}: config groups with different block structures {blocks} are not "
                                  "supported")
        block = blocks[0] if blocks else None
    if block is None:
        return None
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 1 << 20 for b in block)):
        raise CheckpointError(f"{source}: weight_block_size must be two positive integers, got {block!r}")
    return block[0], block[1]


def _scale_values(scale: CheckpointTensor, source: str) -> np.ndarray:
    values = np.asarray(scale.dequantize(), dtype=np.float32)
    if not np.isfinite(values).all():
        raise CheckpointError(f"{source}: tensor {scale.name!r} holds scales that are not finite")
    if (np.abs(values) > MAX_SCALE).any():  # times 448 they would pass float32's range: no weight is that large
        raise CheckpointError(f"{source}: tensor {scale.name!r} holds scales above {MAX_SCALE:g}")
    return values


def _block_scale(weight: CheckpointTensor, scale: CheckpointTensor, block: tuple[int, int] | None,
                 source: str) -> Fp8Scale:
    if block is None:
        raise CheckpointError(f"{source}: tensor {scale.name!r} is a block scale, but quantization_config gives no "
                              "weight_block_size")
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape) != expected:
        raise CheckpointError(f"{source}: tensor {scale.name!r} has shape {list(scale.shape)}; {weight.name!r} "
                              f"{[rows, cols]} in blocks of {list(block)} needs {list(expected)}")
    # A block larger than the matrix means the same as one as large as it, and expands to no more than it.
    return Fp8Scale(_scale_values(scale, source), (min(block[0], rows), min(block[1], cols)))


def _channel_scale(weight: CheckpointTensor, scale: CheckpointTensor, block: tuple[int, int] | None,
                   source: str) -> Fp8Scale:
    """``weight_scale``: per tensor, per row, or (llm-compressor's block strategy) per block of the config's."""
    rows, cols = weight.shape
    if tuple(scale.shape) in ((), (1,)):
        return Fp8Scale(_scale_values(scale, source).reshape(1, 1), (rows, cols))
    if tuple(scale.shape) in ((rows,), (rows, 1)):
        return Fp8Scale(_scale_values(scale, source).reshape(rows, 1), (1, cols))
    if block is not None:
        return _block_scale(weight, scale, block, source)
    raise CheckpointError(f"{source}: tensor {scale.name!r} has shape {list(scale.shape)}; a scale of "
                          f"{weight.name!r} {[rows, cols]} is per tensor ([] or [1]) or per row ([{rows}, 1])")
