"""Normalise a Hugging Face ``config.json`` or GGUF metadata into one :class:`ModelConfig`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

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


def config_from_hf(
    raw: Mapping[str, Any], *, source: str, has_lm_head: bool, generation_eos: object = None
) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json.

    ``has_lm_head`` decides tying when the config does not say, and
    ``generation_eos`` (generation_config.json's ``eos_token_id``) adds the
    end-of-turn ids that chat models often list only there.
    """
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
        extra={k: v for k, v in raw.items() if k not in _HF_CONSUMED},
    )
    return _build(fields, source)


def config_from_gguf(meta: Mapping[str, Any], *, source: str, tensor_names: set[str]) -> ModelConfig:
    """Build a ModelConfig from decoded GGUF metadata and the names of the file's tensors."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise CheckpointError(f"{source}: GGUF metadata lacks 'general.architecture'")
    prefix = f"{arch}."
    fields = {field: meta[prefix + key] for key, field in _GGUF_FIELDS.items() if prefix + key in meta}
    if "vocab_size" not in fields and "tokenizer.ggml.tokens" in meta:
        fields["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    fields.update(
        architecture=arch,
        rope_scaling=_gguf_rope_scaling(meta, prefix + "rope.scaling."),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        # llama.cpp ends generation on end-of-turn and end-of-message tokens too, not only on EOS.
        eos_token_ids=token_ids(*(meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))),
        extra={
            k.removeprefix(prefix): v
            for k, v in meta.items()
            if k.startswith(prefix)
            and k.removeprefix(prefix) not in _GGUF_FIELDS
            and not k.startswith(prefix + "rope.scaling.")
        },
    )
    return _build(fields, source)


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


def _build(fields: dict[str, Any], source: str) -> ModelConfig:
    # head_dim defaults to hidden/heads, as in transformers, and needs both to be valid first.
    for key in ("hidden_size", "num_attention_heads"):
        value = fields.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{source}: {key!r} must be a positive integer, got {value!r}")
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    fields.setdefault("num_key_value_heads", fields["num_attention_heads"])
    try:
        # strict=False accepts the ints GGUF stores for floats (and floats like 1e-06 for eps).
        return msgspec.convert(fields, ModelConfig, strict=False)
    except msgspec.ValidationError as e:
        raise CheckpointError(f"{source}: invalid model config: {e}") from None
