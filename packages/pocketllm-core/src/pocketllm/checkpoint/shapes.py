"""Every tensor's shape checked against the model config, before any backend trusts either.

A file whose metadata says one thing and whose tensors another (an embedding with fewer rows than the
vocabulary, a hidden size one off) must fail at load with both shapes and the metadata key named, not index
out of bounds halfway through a request.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from pocketllm.checkpoint.tensor import CheckpointTensor
from pocketllm.errors import CheckpointError
from pocketllm.model_config import ModelConfig

# A dimension is a product of config fields.
Dim = tuple[str, ...]

# Tensors every decoder-only architecture has, whatever else it has.
_COMMON: dict[str, tuple[Dim, ...]] = {
    "model.embed_tokens.weight": (("vocab_size",), ("hidden_size",)),
    "lm_head.weight": (("vocab_size",), ("hidden_size",)),
    "model.norm.weight": (("hidden_size",),),
}
_Q, _KV = ("num_attention_heads", "head_dim"), ("num_key_value_heads", "head_dim")
# Per-layer tensors of the Llama family (Llama, Mistral, Qwen2, Qwen3), by the name after "model.layers.N.".
_LLAMA_LAYER: dict[str, tuple[Dim, ...]] = {
    "input_layernorm.weight": (("hidden_size",),),
    "post_attention_layernorm.weight": (("hidden_size",),),
    "self_attn.q_proj.weight": (_Q, ("hidden_size",)),
    "self_attn.k_proj.weight": (_KV, ("hidden_size",)),
    "self_attn.v_proj.weight": (_KV, ("hidden_size",)),
    "self_attn.o_proj.weight": (("hidden_size",), _Q),
    "self_attn.q_proj.bias": (_Q,),
    "self_attn.k_proj.bias": (_KV,),
    "self_attn.v_proj.bias": (_KV,),
    "self_attn.q_norm.weight": (("head_dim",),),
    "self_attn.k_norm.weight": (("head_dim",),),
    "mlp.gate_proj.weight": (("intermediate_size",), ("hidden_size",)),
    "mlp.up_proj.weight": (("intermediate_size",), ("hidden_size",)),
    "mlp.down_proj.weight": (("hidden_size",), ("intermediate_size",)),
}
LAYER_RULES: dict[str, dict[str, tuple[Dim, ...]]] = {
    arch: _LLAMA_LAYER for arch in ("llama", "mistral", "qwen2", "qwen3")
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def check_shapes(tensors: Iterable[CheckpointTensor], config: ModelConfig, key_of: Callable[[str], str]) -> None:
    """Raise CheckpointError for the first tensor whose shape disagrees with ``config``.

    ``key_of`` names the metadata key a config field came from (``llama.embedding_length``,
    ``config.json: hidden_size``), so the message points at whichever of the two is wrong.
    """
    layer_rules = LAYER_RULES.get(config.architecture, {})
    for tensor in tensors:
        rule = _COMMON.get(tensor.name)
        match = _LAYER.fullmatch(tensor.name)
        if match is not None:
            if int(match[1]) >= config.num_hidden_layers:
                raise CheckpointError(f"{tensor.path}: tensor {tensor.file_name!r} belongs to layer {match[1]}, but "
                                      f"{key_of('num_hidden_layers')} says {config.num_hidden_layers} layers")
            rule = layer_rules.get(match[2])
        if rule is None:
            continue
        expected = tuple(_product(config, dim) for dim in rule)
        if tuple(tensor.shape) != expected:
            fields = sorted({f for dim in rule for f in dim})
            implied = ", ".join(" * ".join(dim) for dim in rule)
            raise CheckpointError(
                f"{tensor.path}: tensor {tensor.file_name!r} has shape {list(tensor.shape)}, but the config implies "
                f"{list(expected)} ({implied}; from {', '.join(key_of(f) for f in fields)})")


def _product(config: ModelConfig, dim: Dim) -> int:
    value = 1
    for name in dim:
        value *= getattr(config, name)
    return value
