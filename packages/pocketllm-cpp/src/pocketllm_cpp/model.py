"""Build the native model from a checkpoint: matrices stay in their file bytes, norms become float32 copies."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pocketllm.errors import CheckpointError, UnsupportedOptionError
from pocketllm.rope import rope_frequencies
from pocketllm_cpp import _native
from pocketllm_cpp.name import NAME

if TYPE_CHECKING:
    from pocketllm.checkpoint import Checkpoint, CheckpointTensor

ARCHITECTURES = ("llama", "qwen3")
STORAGE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # read in place
_MATRICES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_NORMS = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


def build_model(checkpoint: Checkpoint, *, num_blocks: int, block_size: int, num_threads: int | None = None,
                exact_activations: bool = False, kv_cache_dtype: str = "float16") -> _native.Model:
    """The native model over ``checkpoint``'s tensors. With ``exact_activations``, block weights multiply float32
    activations (a float32 reference's arithmetic) instead of 8-bit ones (llama.cpp's, faster). The KV cache
    holds ``kv_cache_dtype`` values: float16 (half the bytes attention reads) or float32."""
    config = checkpoint.config
    if config.architecture not in ARCHITECTURES:
        raise UnsupportedOptionError("model", NAME, f"architecture {config.architecture!r}")
    if config.attention_bias or config.mlp_bias:
        raise UnsupportedOptionError("model", NAME, "linear biases are not implemented yet")
    tensors = {t.name: t for t in checkpoint.tensors()}

    def take(name: str) -> CheckpointTensor:
        if name not in tensors:
            raise CheckpointError(f"{checkpoint.path}: checkpoint has no tensor {name!r}")
        return tensors[name]

    permuted = {t.row_permutation is not None for t in tensors.values() if t.name.endswith("q_proj.weight")}
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = {key: _matrix(take(f"{p}{name}.weight")) for key, name in _MATRICES.items()}
        for key, name in _NORMS.items():
            if f"{p}{name}.weight" in tensors:
                layer[key] = _vector(take(f"{p}{name}.weight"))
        layers.append(layer)
    embedding = take("model.embed_tokens.weight")
    lm_head = embedding if config.tie_word_embeddings else take("lm_head.weight")
    inv_freq, attention = rope_frequencies(config, NAME)
    native_config = {
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads, "num_kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim, "rms_norm_eps": config.rms_norm_eps,
        # llama.cpp stores Llama q/k rows so that RoPE rotates adjacent pairs: run them that way, unpermuted.
        "rope_pairs_adjacent": permuted == {True}, "qk_norm": config.architecture == "qwen3",
        "exact_activations": exact_activations, "inv_freq": inv_freq.tolist(), "rope_attention_factor": attention,
        "kv_cache_dtype": kv_cache_dtype,
    }
    return _native.Model(native_config, _matrix(embedding), layers, _vector(take("model.norm.weight")),
                         _matrix(lm_head), num_blocks, block_size, num_threads or _native.available_cpus())


def _matrix(tensor: CheckpointTensor) -> tuple[np.ndarray, str, int, int]:
    """A matrix as the kernels take it: its file bytes where they can read its storage type, else a float32 copy."""
    rows, cols = tensor.shape
    if tensor.storage_type in STORAGE_TYPES:
        return np.frombuffer(tensor.data, dtype=np.uint8), tensor.storage_type, rows, cols
    dense = np.ascontiguousarray(tensor.dequantize(), dtype=np.float32)
    if tensor.row_permutation is not None:  # dequantize() undid it; the kernels expect the file's order
        raise UnsupportedOptionError("quantization", NAME, f"{tensor.storage_type} q/k matrices of a permuted GGUF")
    return dense.view(np.uint8).reshape(-1), "F32", rows, cols


def _vector(tensor: CheckpointTensor) -> np.ndarray:
    return np.ascontiguousarray(tensor.dequantize(), dtype=np.float32).reshape(-1)
