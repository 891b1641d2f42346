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

# A dimension is a product of config fields (ModelConfig's, derived ones below, or the config's extras) and
# constants.
Dim = tuple[str | int, ...]

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
_HV, _VALUE = ("linear_num_value_heads",), ("linear_num_value_heads", "linear_value_head_dim")
# Qwen3.5: gated attention (q_proj doubled: queries and their output gates) and Gated DeltaNet layers.
_QWEN3_5_LAYER: dict[str, tuple[Dim, ...]] = {
    **_LLAMA_LAYER,
    "self_attn.q_proj.weight": ((*_Q, 2), ("hidden_size",)),
    "linear_attn.in_proj_qkv.weight": (("linear_conv_dim",), ("hidden_size",)),
    "linear_attn.in_proj_z.weight": (_VALUE, ("hidden_size",)),
    "linear_attn.in_proj_b.weight": (_HV, ("hidden_size",)),
    "linear_attn.in_proj_a.weight": (_HV, ("hidden_size",)),
    "linear_attn.conv1d.weight": (("linear_conv_dim",), (1,), ("linear_conv_kernel_dim",)),
    "linear_attn.dt_bias": (_HV,),
    "linear_attn.A_log": (_HV,),
    "linear_attn.norm.weight": (("linear_value_head_dim",),),
    "linear_attn.out_proj.weight": (("hidden_size",), _VALUE),
}
_EXPERT, _SHARED = ("moe_intermediate_size",), ("shared_expert_intermediate_size",)
_MOE_LAYER: dict[str, tuple[Dim, ...]] = {
    "mlp.gate.weight": (("num_experts",), ("hidden_size",)),
    "mlp.experts.*.gate_proj.weight": (_EXPERT, ("hidden_size",)),
    "mlp.experts.*.up_proj.weight": (_EXPERT, ("hidden_size",)),
    "mlp.experts.*.down_proj.weight": (("hidden_size",), _EXPERT),
    "mlp.experts.gate_proj.weight": (("num_experts",), _EXPERT, ("hidden_size",)),  # stacked (GGUF)
    "mlp.experts.up_proj.weight": (("num_experts",), _EXPERT, ("hidden_size",)),
    "mlp.experts.down_proj.weight": (("num_experts",), ("hidden_size",), _EXPERT),
    "mlp.experts.gate_up_proj": (("num_experts",), (2, *_EXPERT), ("hidden_size",)),  # transformers' fused form
    "mlp.experts.down_proj": (("num_experts",), ("hidden_size",), _EXPERT),
    "mlp.shared_expert.gate_proj.weight": (_SHARED, ("hidden_size",)),
    "mlp.shared_expert.up_proj.weight": (_SHARED, ("hidden_size",)),
    "mlp.shared_expert.down_proj.weight": (("hidden_size",), _SHARED),
    "mlp.shared_expert_gate.weight": ((1,), ("hidden_size",)),
}
# The tensors of Qwen3.5 GGUF files that keep llama.cpp's names (it changed their values), after "blk.N.".
_QWEN3_5_GGUF_LAYER: dict[str, tuple[Dim, ...]] = {
    "attn_norm.weight": (("hidden_size",),),
    "post_attention_norm.weight": (("hidden_size",),),
    "attn_q_norm.weight": (("head_dim",),),
    "attn_k_norm.weight": (("head_dim",),),
    "attn_qkv.weight": (("linear_conv_dim",), ("hidden_size",)),
    "attn_gate.weight": (_VALUE, ("hidden_size",)),
    "ssm_beta.weight": (_HV, ("hidden_size",)),
    "ssm_alpha.weight": (_HV, ("hidden_size",)),
    "ssm_conv1d.weight": (("linear_conv_dim",), ("linear_conv_kernel_dim",)),
    "ssm_a": (_HV,),
    "ssm_dt.bias": (_HV,),
    "ssm_out.weight": (("hidden_size",), _VALUE),
}
_GGUF_TOP_LEVEL: dict[str, tuple[Dim, ...]] = {"output_norm.weight": (("hidden_size",),)}
LAYER_RULES: dict[str, dict[str, tuple[Dim, ...]]] = {
    **{arch: _LLAMA_LAYER for arch in ("llama", "mistral", "qwen2", "qwen3")},
    "qwen3_5_text": _QWEN3_5_LAYER,
    "qwen3_5_moe_text": _QWEN3_5_LAYER | _MOE_LAYER,
}
GGUF_LAYER_RULES = {"qwen3_5_text": _QWEN3_5_GGUF_LAYER, "qwen3_5_moe_text": _QWEN3_5_GGUF_LAYER}
# Sizes the config implies without naming them, and the fields each comes from (which errors name).
_DERIVED: dict[str, Callable[[ModelConfig], int]] = {
    "linear_conv_dim": lambda c: (2 * _field(c, "linear_num_key_heads") * _field(c, "linear_key_head_dim")
                                  + _field(c, "linear_num_value_heads") * _field(c, "linear_value_head_dim")),
}
_DERIVED_FROM = {"linear_conv_dim": ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
                                     "linear_value_head_dim")}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)|blk\.(\d+)\.(.+)")
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def check_shapes(tensors: Iterable[CheckpointTensor], config: ModelConfig, key_of: Callable[[str], str]) -> None:
    """Raise CheckpointError for the first tensor whose shape disagrees with ``config``.

    ``key_of`` names the metadata key a config field came from (``llama.embedding_length``,
    ``config.json: hidden_size``), so the message points at whichever of the two is wrong.
    """
    layer_rules = LAYER_RULES.get(config.architecture, {})
    gguf_rules = GGUF_LAYER_RULES.get(config.architecture)
    for tensor in tensors:
        rule = _COMMON.get(tensor.name) or (_GGUF_TOP_LEVEL.get(tensor.name) if gguf_rules else None)
        match = _LAYER.fullmatch(tensor.name)
        if match is not None and (match[1] is not None or gguf_rules is not None):
            layer, rest, rules = (match[1], match[2], layer_rules) if match[1] else (match[3], match[4], gguf_rules)
            if int(layer) >= config.num_hidden_layers:
                raise CheckpointError(f"{tensor.path}: tensor {tensor.file_name!r} belongs to layer {layer}, but "
                                      f"{key_of('num_hidden_layers')} says {config.num_hidden_layers} layers")
            rule = rules.get(_EXPERT_INDEX.sub(".experts.*.", rest))
        if rule is None:
            continue
        expected = tuple(_product(config, dim) for dim in rule)
        if tuple(tensor.shape) != expected:
            fields = sorted({g for dim in rule for f in dim if isinstance(f, str) for g in _DERIVED_FROM.get(f, (f,))})
            implied = ", ".join(" * ".join(map(str, dim)) for dim in rule)
            raise CheckpointError(
                f"{tensor.path}: tensor {tensor.file_name!r} has shape {list(tensor.shape)}, but the config implies "
                f"{list(expected)} ({implied}; from {', '.join(key_of(f) for f in fields)})")


def _product(config: ModelConfig, dim: Dim) -> int:
    value = 1
    for name in dim:
        value *= name if isinstance(name, int) else _DERIVED[name](config) if name in _DERIVED else _field(config, name)
    return value


def _field(config: ModelConfig, name: str) -> int:
    value = getattr(config, name, None) if name in ModelConfig.__struct_fields__ else config.extra.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"the model config's {name!r} must be an integer, got {value!r}")
    return value
