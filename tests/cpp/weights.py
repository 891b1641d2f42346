"""Random weight matrices in each storage type the kernels read, with their exact values, and the 8-bit activation
rounding the integer kernels apply: shared by the kernel and MoE tests."""

from __future__ import annotations

import gguf
import numpy as np

QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4", "IQ4_XS",
                   "Q2_K", "Q3_K")
K_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K")
BLOCK32_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "MXFP4")  # blocks of 32 values
# MXFP4 exponents: the subnormal scales (e < 2), the smallest normal ones, and those of weights near 1.
MXFP4_EXPONENTS = np.array([0, 1, 2, 3, 120, 124, 126, 127, 128, 129], dtype=np.uint8)


def random_weight(storage_type: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes, float64 values) of a random matrix stored as ``storage_type``."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    if storage_type == "F32":
        return w.view(np.uint8).reshape(-1), w.astype(np.float64)
    if storage_type == "F16":
        half = w.astype(np.float16)
        return half.view(np.uint8).reshape(-1), half.astype(np.float64)
    t = gguf.GGMLQuantizationType[storage_type]
    if storage_type in K_TYPES:  # gguf has no K-quant quantizer: random blocks with sane super-block scales
        return random_k_blocks(storage_type, rows, cols, seed)
    if storage_type in ("IQ4_NL", "MXFP4", "IQ4_XS"):  # every codebook index, and every kind of scale
        return random_codebook_blocks(storage_type, rows, cols, seed)
    blocks = gguf.quants.quantize(w, t)
    return np.ascontiguousarray(blocks).reshape(-1), gguf.quants.dequantize(blocks, t).astype(np.float64)


def random_k_blocks(storage_type: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    t = gguf.GGMLQuantizationType[storage_type]
    block_size, type_size = gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    scales = (rng.random((blocks.shape[0], 2)) * 0.01 + 0.001).astype(np.float16).view(np.uint8)
    if storage_type in ("Q6_K", "Q3_K"):
        blocks[:, -2:] = scales[:, :2]  # d comes last
    elif storage_type == "Q2_K":
        blocks[:, -4:] = scales  # d, dmin last
    else:
        blocks[:, :4] = scales  # d, dmin first
    return blocks.reshape(-1), gguf.quants.dequantize(blocks, t).reshape(rows, cols).astype(np.float64)


def random_codebook_blocks(storage_type: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    t = gguf.GGMLQuantizationType[storage_type]
    block_size, type_size = gguf.GGML_QUANT_SIZES[t]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    if storage_type == "MXFP4":
        blocks[:, 0] = rng.choice(MXFP4_EXPONENTS, len(blocks))
    else:
        blocks[:, :2] = (rng.random((len(blocks), 1)) * 0.02 + 0.001).astype(np.float16).view(np.uint8)
    return blocks.reshape(-1), gguf.quants.dequantize(blocks, t).reshape(rows, cols).astype(np.float64)


def reference_activations(x: np.ndarray) -> np.ndarray:
    """x after 8-bit block quantization, as the kernels do it: d = max|x| / 127, q = rint(x / d), float32."""
    blocks = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0).astype(np.float32)
    q = np.rint(blocks * inv)  # float32 product, rounded half to even
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)
