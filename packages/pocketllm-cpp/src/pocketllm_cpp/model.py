"""Build the native model from a checkpoint, by architecture: matrices stay in their file bytes, norms become
float32 copies."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from pocketllm.errors import UnsupportedOptionError
from pocketllm.rope import rope_frequencies
from pocketllm_cpp import _native, qwen3_5
from pocketllm_cpp.loading import STORAGE_TYPES, BuildOptions, Tensors, vector
from pocketllm_cpp.name import NAME

if TYPE_CHECKING:
    from pocketllm.checkpoint import Checkpoint

__all__ = ["ARCHITECTURES", "HYBRID", "STORAGE_TYPES", "build_model", "num_attention_layers", "state_slot_bytes"]
_MATRICES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}
_NORMS = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


class _Builder(Protocol):
    def __call__(self, checkpoint: Checkpoint, options: BuildOptions) -> _native.Model: ...


def build_model(checkpoint: Checkpoint, *, num_blocks: int, block_size: int, num_threads: int | None = None,
                exact_activations: bool = False, kv_cache_dtype: str = "float16",
                num_state_slots: int = 1, mtp: bool = False) -> _native.Model:
    """The native model over ``checkpoint``'s tensors. With ``exact_activations``, block weights multiply float32
    activations (a float32 reference's arithmetic) instead of 8-bit ones (llama.cpp's, faster). The KV cache
    holds ``kv_cache_dtype`` values: float16 (half the bytes attention reads) or float32. Hybrid models hold
    ``num_state_slots`` requests' states (max_num_seqs). ``mtp``: with the checkpoint's multi-token-prediction
    head (Qwen3.5), for speculative decoding."""
    config = checkpoint.config
    if config.architecture not in _BUILDERS:
        raise UnsupportedOptionError("model", NAME, f"architecture {config.architecture!r}")
    if config.attention_bias or config.mlp_bias:
        raise UnsupportedOptionError("model", NAME, "linear biases are not implemented yet")
    options = BuildOptions(num_blocks=num_blocks, block_size=block_size,
                           num_threads=num_threads or _native.available_cpus(), exact_activations=exact_activations,
                           kv_cache_dtype=kv_cache_dtype, num_state_slots=num_state_slots, mtp=mtp)
    if mtp and config.architecture not in HYBRID:
        raise UnsupportedOptionError("speculative_method", NAME, f"'mtp' has no multi-token-prediction head for "
                                     f"{config.architecture!r}")
    return _BUILDERS[config.architecture](checkpoint, options)


def num_attention_layers(checkpoint: Checkpoint, mtp: bool = False) -> int:
    """Layers that keep KV in the paged cache (what the KV budget counts), the MTP head's with ``mtp``."""
    config = checkpoint.config
    model = qwen3_5.num_attention_layers(config) if config.architecture in HYBRID else config.num_hidden_layers
    return model + int(mtp)


def state_slot_bytes(checkpoint: Checkpoint) -> int:
    """One request's fixed-size state (0 for models without state layers)."""
    config = checkpoint.config
    return qwen3_5.state_slot_bytes(config) if config.architecture in HYBRID else 0


def _build_llama(checkpoint: Checkpoint, options: BuildOptions) -> _native.Model:
    config = checkpoint.config
    tensors = Tensors(checkpoint.path, checkpoint.tensors())
    permuted = {t.row_permutation is not None for t in tensors.by_name.values() if t.name.endswith("q_proj.weight")}
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        layer = _native.LlamaLayer()
        for key, name in _MATRICES.items():
            setattr(layer, key, tensors.matrix(f"{p}{name}.weight"))
        for key, name in _NORMS.items():
            if tensors.has(f"{p}{name}.weight"):
                setattr(layer, key, vector(tensors.take(f"{p}{name}.weight")).tolist())
        layers.append(layer)
    lm_head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    inv_freq, attention = rope_frequencies(config, NAME)
    c = _native.LlamaConfig()
    c.vocab_size, c.hidden_size, c.intermediate_size = config.vocab_size, config.hidden_size, config.intermediate_size
    c.num_layers, c.num_heads = config.num_hidden_layers, config.num_attention_heads
    c.num_kv_heads, c.head_dim, c.rms_norm_eps = config.num_key_value_heads, config.head_dim, config.rms_norm_eps
    # llama.cpp stores Llama q/k rows so that RoPE rotates adjacent pairs: run them that way, unpermuted.
    c.rope_pairs_adjacent, c.qk_norm = permuted == {True}, config.architecture == "qwen3"
    c.exact_activations, c.kv_cache_dtype = options.exact_activations, options.kv_cache_dtype
    c.inv_freq, c.rope_attention_factor = inv_freq.tolist(), attention
    return _native.llama_model(c, tensors.matrix("model.embed_tokens.weight"), layers,
                               vector(tensors.take("model.norm.weight")).tolist(), tensors.matrix(lm_head),
                               options.num_blocks, options.block_size, options.num_threads)


_BUILDERS: dict[str, _Builder] = {"llama": _build_llama, "qwen3": _build_llama,
                                  "qwen3_5_text": qwen3_5.build, "qwen3_5_moe_text": qwen3_5.build}
HYBRID = ("qwen3_5_text", "qwen3_5_moe_text")
ARCHITECTURES = tuple(_BUILDERS)
