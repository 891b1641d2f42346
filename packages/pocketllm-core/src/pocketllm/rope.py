"""RoPE frequencies of a model config, with the scalings backends share (numpy, float32 as transformers)."""

from __future__ import annotations

import math

import numpy as np

from pocketllm.errors import UnsupportedOptionError
from pocketllm.model_config import ModelConfig


def rope_frequencies(config: ModelConfig, backend: str, dim: int | None = None) -> tuple[np.ndarray, float]:
    """The frequency of each pair of the ``dim`` rotated head dimensions (all of them by default; fewer with
    partial RoPE) and the factor cos and sin are scaled by, with linear, Llama 3.1 or YaRN scaling where the
    config asks; UnsupportedOptionError (option ``rope_scaling``, naming ``backend``) for any other scaling."""
    dim = dim or config.head_dim
    exponents = np.arange(0, dim, 2, dtype=np.float32) / dim
    inv_freq = np.float32(1.0) / np.float32(config.rope_theta) ** exponents
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if kind == "yarn":
        return _yarn(config, scaling, dim)
    raise UnsupportedOptionError("rope_scaling", backend, f"rope type {kind!r} is not implemented")


def _llama3(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """Llama 3.1: slow down low frequencies, keep high ones, interpolate between."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def _yarn(config: ModelConfig, scaling: dict, dim: int) -> tuple[np.ndarray, float]:
    """YaRN (arXiv 2309.00071) as transformers computes it: frequencies below the correction range are
    interpolated by ``factor``, those above kept, a linear ramp between; cos and sin scale by the attention
    factor (0.1 ln(factor) + 1 unless the config gives it or mscale/mscale_all_dim)."""
    base = config.rope_theta
    old_len = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = scaling.get("factor") or config.max_position_embeddings / old_len

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1 - ramp
    positions = np.float32(base) ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    interpolated, kept = 1.0 / (np.float32(factor) * positions), 1.0 / positions
    return (interpolated * (1 - extrapolation) + kept * extrapolation).astype(np.float32), float(attention)
