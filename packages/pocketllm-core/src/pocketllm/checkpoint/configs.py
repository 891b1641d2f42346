"""Normalise a Hugging Face ``config.json`` or GGUF metadata into one :class:`ModelConfig`."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from pocketllm.checkpoint.base import RecommendedSetting
from pocketllm.errors import CheckpointError
from pocketllm.model_config import ModelConfig

# config.json keys read into ModelConfig fields; every other key goes to ``extra``.
_HF_CONSUMED = frozenset(
    {
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "bos_token_id",
        "eos_token_id",
    }
)

# GGUF ``{arch}.<key>`` metadata read into ModelConfig fields; the other ``{arch}.*`` keys go to ``extra``.
_GGUF_FIELDS = {
    "block_count": "num_hidden_layers",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "context_length": "max_position_embeddings",
    "vocab_size": "vocab_size",
}
# GGUF rope.scaling keys whose Hugging Face name differs.
_GGUF_ROPE_KEYS = {"original_context_length": "original_max_position_embeddings"}
# GGUF architecture names of the families both llama.cpp and transformers know -> transformers' model_type.
# Any other architecture keeps its GGUF name, and its tensors theirs.
GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "qwen3next": "qwen3_next",
    "qwen35": "qwen3_5_text",
    "qwen35moe": "qwen3_5_moe_text",
}
# ``{arch}.<key>`` metadata of mapped architectures that goes to ``extra`` under its Hugging Face name.
_GGUF_EXTRA_NAMES = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    "full_attention_interval": "full_attention_interval",
    "ssm.conv_kernel": "linear_conv_kernel_dim",
    "ssm.state_size": "linear_key_head_dim",
    "ssm.group_count": "linear_num_key_heads",
    "ssm.time_step_rank": "linear_num_value_heads",
}


# Multimodal wrappers whose text model is served: model_type -> the text config's model_type. Their fields sit
# under ``text_config`` and their text weights under ``model.language_model.*`` (see TEXT_MODEL_PREFIX).
TEXT_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def text_config_of(raw: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's config of a multimodal wrapper (``raw`` itself for any other model)."""
    model_type = raw.get("model_type")
    text = raw.get("text_config")
    if model_type not in TEXT_WRAPPERS or not isinstance(text, dict):
        return raw
    inherited = {k: raw[k] for k in ("tie_word_embeddings", "eos_token_id", "bos_token_id") if k in raw}
    return inherited | text | {"model_type": text.get("model_type") or TEXT_WRAPPERS[model_type]}


def config_from_hf(
    raw: Mapping[str, Any], *, source: str, has_lm_head: bool, generation_eos: object = None
) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json.

    ``has_lm_head`` decides tying when the config does not say, and
    ``generation_eos`` (generation_config.json's ``eos_token_id``) adds the
    end-of-turn ids that chat models often list only there.
    """
    raw = text_config_of(raw)
    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{source}: missing 'model_type'")
    # transformers 5 writes rope_parameters; older configs have rope_theta and rope_scaling.
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    rope_scaling = raw.get("rope_scaling")
    if rope_scaling is None and rope.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    fields = {k: raw[k] for k in _HF_CONSUMED.intersection(ModelConfig.__struct_fields__) if raw.get(k) is not None}
    fields.update(
        architecture=model_type.lower(),
        rope_theta=raw.get("rope_theta") or rope.get("rope_theta") or 10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=raw.get("tie_word_embeddings", not has_lm_head),
        eos_token_ids=token_ids(raw.get("eos_token_id"), generation_eos),
        extra={k: v for k, v in raw.items() if k not in _HF_CONSUMED}
        # Partial RoPE (Qwen3.5: a quarter of each head rotates), from rope_parameters in transformers 5.
        | ({"partial_rotary_factor": rope["partial_rotary_factor"]} if "partial_rotary_factor" in rope else {}),
    )
    config = _build(fields, source, hf_key_of)
    named = {hf_key_of("bos_token_id"): raw.get("bos_token_id"), hf_key_of("eos_token_id"): raw.get("eos_token_id"),
             "generation_config.json 'eos_token_id'": generation_eos}
    _check_token_ids(named, config.vocab_size, source, hf_key_of("vocab_size"))
    return config


def config_from_gguf(meta: Mapping[str, Any], *, source: str, tensor_names: set[str]) -> ModelConfig:
    """Build a ModelConfig from decoded GGUF metadata and the names of the file's tensors."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise CheckpointError(f"{source}: GGUF metadata lacks 'general.architecture'")
    prefix = f"{arch}."
    mapped = arch in GGUF_ARCHITECTURES
    fields = {field: meta[prefix + key] for key, field in _GGUF_FIELDS.items() if prefix + key in meta}
    if "vocab_size" not in fields and "tokenizer.ggml.tokens" in meta:
        fields["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    fields.update(
        architecture=GGUF_ARCHITECTURES.get(arch, arch),
        rope_scaling=_gguf_rope_scaling(meta, prefix + "rope.scaling."),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        # llama.cpp ends generation on end-of-turn and end-of-message tokens too, not only on EOS.
        eos_token_ids=token_ids(*(meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))),
        extra={
            _extra_name(k.removeprefix(prefix), mapped): v
            for k, v in meta.items()
            if k.startswith(prefix)
            and k.removeprefix(prefix) not in _GGUF_FIELDS
            and not k.startswith(prefix + "rope.scaling.")
        },
    )
    if mapped:
        fields["extra"] |= _derived_extras(fields, fields["extra"])
        # Newer converters count Qwen3.5's multi-token-prediction layers in block_count and store them after
        # the model's own (blk.<n>.* from n = the model's layer count); the reader skips them.
        nextn = fields["extra"].get("nextn_predict_layers")
        if _positive(nextn) and _positive(fields.get("num_hidden_layers")) and nextn < fields["num_hidden_layers"]:
            fields["num_hidden_layers"] -= nextn
        if fields["architecture"] in _HYBRID:
            fields["extra"]["layer_types"] = _gguf_layer_types(meta, prefix, fields.get("num_hidden_layers"), source)
    config = _build(fields, source, lambda field: gguf_key_of(field, meta))
    named = {key: meta[key] for key in (f"tokenizer.ggml.{k}_token_id" for k in _GGUF_TOKEN_IDS) if key in meta}
    _check_token_ids(named, config.vocab_size, source, gguf_key_of("vocab_size", meta))
    return config


# The ids of special tokens that GGUF metadata may give (tokenizer.ggml.<name>_token_id).
_GGUF_TOKEN_IDS = ("bos", "eos", "eot", "eom", "unknown", "padding", "seperator", "cls", "mask")
# Far beyond any model's layer count: a bound checked before per-layer lists are built from metadata (whether the
# tensors bear the count out is checked at engine load: see shapes.check_model).
MAX_LAYERS = 1 << 16


# Mapped architectures that mix linear-attention (recurrent) layers with full-attention ones.
_HYBRID = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})


def _gguf_layer_types(meta: Mapping[str, Any], prefix: str, layers: object, source: str) -> list[str]:
    """Hugging Face's layer_types of a hybrid model, as llama.cpp reads them: ``attention.recurrent_layers`` (one
    flag per layer, the multi-token-prediction layers after the model's included), else every
    ``full_attention_interval``-th layer (4 by default) full attention."""
    if not _positive(layers) or layers > MAX_LAYERS:
        raise CheckpointError(f"{source}: {prefix}block_count must be a positive integer up to {MAX_LAYERS}, got "
                              f"{layers!r}")
    key = prefix + "attention.recurrent_layers"
    flags = meta.get(key)
    if flags is not None:
        total = meta.get(prefix + "block_count")
        if not isinstance(flags, list) or len(flags) != total or not all(isinstance(f, bool) for f in flags):
            raise CheckpointError(f"{source}: {key} must hold one true/false flag for each of the {total} layers "
                                  f"({prefix}block_count), got {_shorten(flags)}")
        return ["linear_attention" if recurrent else "full_attention" for recurrent in flags[:layers]]
    interval = meta.get(prefix + "full_attention_interval", 4)
    if not _positive(interval):
        raise CheckpointError(f"{source}: {prefix}full_attention_interval must be a positive integer, got "
                              f"{interval!r}")
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def _shorten(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _derived_extras(fields: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """Hugging Face config fields that llama.cpp stores only as products: the value head size of linear
    attention (``ssm.inner_size`` = heads * head size) and partial RoPE's share of each head
    (``rope.dimension_count`` rotated dimensions). Left out where the stored values do not divide."""
    derived: dict[str, Any] = {}
    inner, heads = extra.get("ssm.inner_size"), extra.get("linear_num_value_heads")
    if _positive(inner) and _positive(heads) and inner % heads == 0:
        derived["linear_value_head_dim"] = inner // heads
    rotated = extra.get("rope.dimension_count")
    head_dim = fields.get("head_dim")
    if head_dim is None and _positive(fields.get("hidden_size")) and _positive(fields.get("num_attention_heads")):
        head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    if _positive(rotated) and _positive(head_dim) and rotated < head_dim:
        derived["partial_rotary_factor"] = rotated / head_dim
    return derived


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _extra_name(key: str, mapped: bool) -> str:
    return _GGUF_EXTRA_NAMES.get(key, key) if mapped else key


def hf_key_of(field: str) -> str:
    """Where a ModelConfig field of a safetensors checkpoint came from, for error messages."""
    return f"config.json {field!r}"


def gguf_key_of(field: str, meta: Mapping[str, Any]) -> str:
    """The GGUF metadata key(s) a ModelConfig field came from, for error messages."""
    prefix = f"{meta.get('general.architecture')}."
    keys = {f: prefix + k for k, f in (_GGUF_FIELDS | _GGUF_EXTRA_NAMES).items()}
    keys["linear_value_head_dim"] = f"{prefix}ssm.inner_size / {prefix}ssm.time_step_rank"
    if prefix + "vocab_size" not in meta:
        keys["vocab_size"] = "the length of tokenizer.ggml.tokens"
    if prefix + "attention.key_length" not in meta:
        keys["head_dim"] = f"{keys['hidden_size']} / {keys['num_attention_heads']}"
    if prefix + "attention.head_count_kv" not in meta:
        keys["num_key_value_heads"] = keys["num_attention_heads"]
    keys["partial_rotary_factor"] = f"{prefix}rope.dimension_count / {keys['head_dim']}"
    keys["layer_types"] = (f"{prefix}attention.recurrent_layers" if f"{prefix}attention.recurrent_layers" in meta
                           else f"{prefix}full_attention_interval")
    return keys.get(field, field)


def _gguf_rope_scaling(meta: Mapping[str, Any], prefix: str) -> dict[str, Any] | None:
    """``{arch}.rope.scaling.*`` as a Hugging Face rope_scaling dict (None when absent or "none")."""
    kind = meta.get(prefix + "type")
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    for key, value in meta.items():
        name = key.removeprefix(prefix)
        if key.startswith(prefix) and name != "type":
            scaling[_GGUF_ROPE_KEYS.get(name, name)] = value
    return scaling


def token_ids(*values: object) -> tuple[int, ...]:
    """Merge ids given as None, an int or a list of ints into one tuple, first occurrence first."""
    ids: list[int] = []
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and not isinstance(item, bool) and item not in ids:
                ids.append(item)
    return tuple(ids)


def _build(fields: dict[str, Any], source: str, key_of: Callable[[str], str]) -> ModelConfig:
    # head_dim defaults to hidden/heads, as in transformers, and needs both to be valid first.
    for key in ("hidden_size", "num_attention_heads"):
        value = fields.get(key)
        if not _positive(value):
            raise CheckpointError(f"{source}: {key_of(key)} must be a positive integer, got {value!r}")
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    try:
        # strict=False accepts the ints GGUF stores for floats (and floats like 1e-06 for eps).
        config = msgspec.convert(fields, ModelConfig, strict=False)
    except msgspec.ValidationError as e:
        raise CheckpointError(f"{source}: invalid model config: {e}") from None
    _check_ranges(config, source, key_of)
    return config


def _check_ranges(config: ModelConfig, source: str, key_of: Callable[[str], str]) -> None:
    """The ranges a model relies on and that tensor shapes do not pin (a head count of 0 would be a division by
    zero in a backend): sizes positive, heads grouping evenly, norms and RoPE finite."""

    def fail(field: str, why: str, value: object) -> CheckpointError:
        return CheckpointError(f"{source}: {key_of(field)} {why}, got {value!r}")

    for field in ("vocab_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "max_position_embeddings"):
        if not _positive(getattr(config, field)):
            raise fail(field, "must be a positive integer", getattr(config, field))
    if config.num_hidden_layers > MAX_LAYERS:
        raise fail("num_hidden_layers", f"must be at most {MAX_LAYERS}", config.num_hidden_layers)
    if config.intermediate_size < 0:
        raise fail("intermediate_size", "must not be negative", config.intermediate_size)
    if config.num_attention_heads % config.num_key_value_heads:
        raise fail("num_key_value_heads", f"must divide the {config.num_attention_heads} attention heads "
                   f"({key_of('num_attention_heads')})", config.num_key_value_heads)
    for field in ("rms_norm_eps", "rope_theta"):
        value = getattr(config, field)
        if not (math.isfinite(value) and value > 0):
            raise fail(field, "must be a positive finite number", value)


def _check_token_ids(named: Mapping[str, object], vocab_size: int, source: str, vocab_key: str) -> None:
    """Special-token ids (EOS, BOS...) must be tokens of the vocabulary: an EOS of 2**32 - 1 would load and fail
    every generation."""
    for key, value in named.items():
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is None:
                continue
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
                raise CheckpointError(f"{source}: {key} holds token id {token!r}, outside the vocabulary of "
                                      f"{vocab_size} tokens ({vocab_key})")


# Recommended sampling settings -> SamplingParams fields: generation_config.json keys (those vLLM reads), and
# llama.cpp's general.sampling.* metadata.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                      "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p",
                      "general.sampling.penalty_repeat": "repetition_penalty"}


def recommended_settings(source_values: Mapping[str, Any], keys: Mapping[str, str]) -> list[RecommendedSetting]:
    """The settings ``source_values`` recommends, unchecked: whether SamplingParams accepts each is
    ``pocketllm.sampling_defaults``'s to say (this package reads files and never imports the request types)."""
    return [RecommendedSetting(key, field, source_values[key]) for key, field in keys.items()
            if source_values.get(key) is not None]
