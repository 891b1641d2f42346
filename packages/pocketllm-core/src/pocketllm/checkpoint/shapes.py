"""Every tensor's shape checked against the model config, before any backend trusts either, and every tensor the
architecture needs present.

A file whose metadata says one thing and whose tensors another (an embedding with fewer rows than the
vocabulary, a hidden size one off, a tensor name corrupted) must fail at load with both shapes, or the missing
tensor, and the metadata key named, not index out of bounds or miss a weight halfway through loading a backend.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from pocketllm.checkpoint.tensor import CheckpointTensor
from pocketllm.errors import CheckpointError
from pocketllm.model_config import ModelConfig

if TYPE_CHECKING:
    from pocketllm.checkpoint.base import Checkpoint

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
        if rule is not None:
            _check(tensor, rule, config, key_of)


# The multi-token-prediction head's own tensors, by the name after "mtp." (Hugging Face) or "blk.N." (GGUF).
_MTP_HEAD: dict[str, tuple[Dim, ...]] = {
    **{f"{name}.weight": (("hidden_size",), (2, "hidden_size")) for name in ("fc", "nextn.eh_proj")},
    **{f"{name}.weight": (("hidden_size",),) for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm",
                                                          "nextn.enorm", "nextn.hnorm", "nextn.shared_head_norm")},
}
_MTP_TENSOR = re.compile(r"(?:mtp\.layers|model\.layers|blk)\.\d+\.(.+)|mtp\.(.+)")


def check_mtp_shapes(tensors: Iterable[CheckpointTensor], config: ModelConfig, key_of: Callable[[str], str]) -> None:
    """``check_shapes`` for a checkpoint's multi-token-prediction tensors (``Checkpoint.mtp_tensors``): the
    head's layer shaped as one of the model's layers, its projection [hidden, 2 * hidden], its norms [hidden]."""
    rules = LAYER_RULES.get(config.architecture, {}) | GGUF_LAYER_RULES.get(config.architecture, {}) | _MTP_HEAD
    for tensor in tensors:
        match = _MTP_TENSOR.fullmatch(tensor.name)
        rule = rules.get(_EXPERT_INDEX.sub(".experts.*.", match[1] or match[2])) if match else None
        if rule is not None:
            _check(tensor, rule, config, key_of)


def _check(tensor: CheckpointTensor, rule: tuple[Dim, ...], config: ModelConfig, key_of: Callable[[str], str]) -> None:
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


# The tensors each layer must have, by architecture (names after "model.layers.N." or "blk.N."), beside the
# top-level ones; tensors not listed (biases, Llama's optional q/k norms) are optional.
_ATTENTION = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight")
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
_DENSE = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
_LLAMA_REQUIRED = (*_NORMS, *_ATTENTION, *_DENSE)
_REQUIRED: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("llama", "mistral", "qwen2"), _LLAMA_REQUIRED),
    "qwen3": (*_LLAMA_REQUIRED, "self_attn.q_norm.weight", "self_attn.k_norm.weight"),
}
# Qwen3.5, by layer type and then MLP kind, in Hugging Face names and in GGUF's (model.layers.N. names the tensors
# llama.cpp only renamed, blk.N. those whose values it changed).
_QWEN3_5_REQUIRED = {
    False: {"common": _NORMS, "full_attention": (*_ATTENTION, "self_attn.q_norm.weight", "self_attn.k_norm.weight"),
            "linear_attention": tuple(f"linear_attn.{n}" for n in (
                "in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
                "dt_bias", "A_log", "norm.weight", "out_proj.weight"))},
    True: {"common": ("blk:attn_norm.weight", "blk:post_attention_norm.weight"),
           "full_attention": (*_ATTENTION, "blk:attn_q_norm.weight", "blk:attn_k_norm.weight"),
           "linear_attention": ("blk:attn_qkv.weight", "blk:attn_gate.weight", "blk:ssm_beta.weight",
                                "blk:ssm_alpha.weight", "blk:ssm_conv1d.weight", "blk:ssm_a", "blk:ssm_dt.bias",
                                "linear_attn.norm.weight", "blk:ssm_out.weight")},
}
_QWEN3_5_MLP = {"qwen3_5_text": _DENSE, "qwen3_5_moe_text": ("mlp.gate.weight",)}
# A GGUF MoE layer's experts, stacked, and its shared expert (safetensors keep experts fused or one by one: the
# backends read either).
_QWEN3_5_MOE_GGUF = (*(f"mlp.experts.{n}_proj.weight" for n in ("gate", "up", "down")),
                     *(f"mlp.shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")),
                     "mlp.shared_expert_gate.weight")


def check_model(checkpoint: Checkpoint) -> None:
    """What a backend relies on beyond each tensor's shape, checked before one is asked for an engine: the layer
    count borne out by the tensors, every tensor the architecture needs present, and the sizes and head counts of
    hybrid and mixture-of-experts layers in range. Raises CheckpointError naming the file and the metadata key or
    tensor; architectures without rules here are left to their backend."""
    config, key_of = checkpoint.config, checkpoint.config_key

    def fail(why: str) -> CheckpointError:
        return CheckpointError(f"{checkpoint.path}: {why}")

    if config.architecture not in _REQUIRED and config.architecture not in _QWEN3_5_MLP:
        return
    by_name = {t.name: t for t in checkpoint.tensors()}
    layers = sorted({int(m[1] or m[3]) for name in by_name if (m := _LAYER.fullmatch(name))})
    if config.num_hidden_layers > (layers[-1] + 1 if layers else 0):
        raise fail(f"{key_of('num_hidden_layers')} says {config.num_hidden_layers} layers, but the tensors stop at "
                   f"{f'layer {layers[-1]}' if layers else 'no layer at all'}")
    if config.architecture in _QWEN3_5_MLP:
        _check_qwen3_5_sizes(config, key_of, fail)
    gguf = checkpoint.format == "gguf"
    top = ["model.embed_tokens.weight", "output_norm.weight" if gguf and config.architecture in _QWEN3_5_MLP
           else "model.norm.weight"] + ([] if config.tie_word_embeddings else ["lm_head.weight"])
    missing = [name for name in top if name not in by_name]
    kinds = _qwen3_5_layer_types(config) if config.architecture in _QWEN3_5_MLP else [""] * config.num_hidden_layers
    for layer, kind in enumerate(kinds):
        missing += [name for name in _layer_names(config, layer, kind, gguf) if name not in by_name]
        if missing:
            break
    if missing:
        match = _LAYER.fullmatch(missing[0])
        index = (match[1] or match[3]) if match else None
        strays = [t.file_name for t in by_name.values() if _stray(t.name, index, config)][:3]
        hint = f"; its tensors of that layer include {', '.join(map(repr, strays))}, which no rule names" \
            if strays else ""
        raise fail(f"the {config.architecture} model needs tensor {missing[0]!r}, which the checkpoint lacks{hint}")
    if config.architecture in _QWEN3_5_MLP:  # a hybrid layer's tensors are all named by a rule: no stray survives
        strays = [t.file_name for t in by_name.values()
                  if (m := _LAYER.fullmatch(t.name)) and _stray(t.name, m[1] or m[3], config)]
        if strays:
            raise fail(f"tensor {strays[0]!r} is not one the {config.architecture} model has")


def _check_qwen3_5_sizes(config: ModelConfig, key_of: Callable[[str], str],
                         fail: Callable[[str], CheckpointError]) -> None:
    extra = config.extra
    for field in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim", *(("num_experts", "num_experts_per_tok")
                                              if config.architecture == "qwen3_5_moe_text" else ())):
        value = extra.get(field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise fail(f"{key_of(field)} must be a positive integer, got {value!r}")
    if extra["linear_num_value_heads"] % extra["linear_num_key_heads"]:
        raise fail(f"{key_of('linear_num_key_heads')} must divide the {extra['linear_num_value_heads']} value heads "
                   f"({key_of('linear_num_value_heads')}), got {extra['linear_num_key_heads']}")
    if "num_experts" in extra and extra.get("num_experts_per_tok", 0) > extra["num_experts"]:
        raise fail(f"{key_of('num_experts_per_tok')} must be at most the {extra['num_experts']} experts "
                   f"({key_of('num_experts')}), got {extra['num_experts_per_tok']}")


def _layer_names(config: ModelConfig, layer: int, kind: str, gguf: bool) -> list[str]:
    """The tensors layer ``layer`` (of type ``kind``, for a hybrid model) needs, by their names in the checkpoint."""
    def full(name: str) -> str:
        return f"blk.{layer}.{name[4:]}" if name.startswith("blk:") else f"model.layers.{layer}.{name}"

    if config.architecture in _REQUIRED:
        return [full(name) for name in _REQUIRED[config.architecture]]
    rules = _QWEN3_5_REQUIRED[gguf]
    mlp = _QWEN3_5_MLP[config.architecture]
    experts = _QWEN3_5_MOE_GGUF if gguf and config.architecture == "qwen3_5_moe_text" else ()
    return [full(name) for name in (*rules["common"], *rules.get(kind, ()), *mlp, *experts)]


def _qwen3_5_layer_types(config: ModelConfig) -> list[str]:
    """The config's layer_types, else every full_attention_interval-th layer full attention (as the backends)."""
    types = config.extra.get("layer_types")
    if isinstance(types, list) and len(types) == config.num_hidden_layers:
        return types
    interval = config.extra.get("full_attention_interval", 4)
    interval = interval if isinstance(interval, int) and interval > 0 else 4
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(config.num_hidden_layers)]


def _stray(name: str, layer: str | None, config: ModelConfig) -> bool:
    """Whether ``name`` is a tensor of ``layer`` that no rule of the architecture names (a corrupted name)."""
    match = _LAYER.fullmatch(name)
    if match is None or (match[1] or match[3]) != layer:
        return False
    rest = match[2] or match[4]
    known = set(LAYER_RULES.get(config.architecture, {})) | set(GGUF_LAYER_RULES.get(config.architecture, {}))
    return _EXPERT_INDEX.sub(".experts.*.", rest) not in known
