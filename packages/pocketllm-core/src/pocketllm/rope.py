"""RoPE frequencies of a model config, with the scalings backends share (numpy, float32 as transformers)."""

from __future__ import annotations

import numpy as np

from pocketllm.errors import UnsupportedOptionError
from pocketllm.model_config import ModelConfig


def rope_inv_freq(config: ModelConfig, backend: str) -> np.ndarray:
    """The frequency of each pair of head dimensions, with linear or Llama 3.1 scaling where the config asks;
    UnsupportedOptionError (option ``rope_scaling``, naming ``backend``) for any other scaling."""
    dim = config.head_dim
    inv_freq = np.float32(1.0) / np.float32(config.rope_theta) ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if kind != "llama3":
        raise UnsupportedOptionError("rope_scaling", backend, f"rope type {kind!r} is not implemented")
    # Llama 3.1: slow down low frequencies, keep high ones, interpolate between.
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)
