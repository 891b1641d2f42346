"""Normalise a Hugging Face ``config.json`` into a :class:`ModelConfig`."""

from __future__ import annotations

from typing import Any

from pocketllm.errors import CheckpointError
from pocketllm.model_config import ModelConfig

# Keys read into ModelConfig fields (or deliberately folded into one); every other key goes to ``extra``.
_CONSUMED = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias", "mlp_bias", "bos_token_id", "eos_token_id",
})


def config_from_hf(raw: dict[str, Any], *, source: str, has_lm_head: bool,
                   generation_eos: object = None) -> ModelConfig:
    """Build a ModelConfig from a parsed config.json.

    ``has_lm_head`` decides tying when the config does not say, and
    ``generation_eos`` (generation_config.json's ``eos_token_id``) adds the
    end-of-turn ids chat models often list only there.
    """
    def required(key: str) -> int:
        value = raw.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise CheckpointError(f"{source}: {key!r} must be a positive integer, got {value!r}")
        return value

    model_type = raw.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{source}: missing 'model_type'")
    hidden, heads = required("hidden_size"), required("num_attention_heads")
    # transformers 5 writes rope_parameters; older configs have rope_theta and rope_scaling.
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    rope_scaling = raw.get("rope_scaling")
    if rope_scaling is None and rope.get("rope_type", "default") != "default":
        rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    try:
        return ModelConfig(
            architecture=model_type.lower(),
            vocab_size=required("vocab_size"),
            hidden_size=hidden,
            intermediate_size=required("intermediate_size"),
            num_hidden_layers=required("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings") or 2048,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", not has_lm_head)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=token_ids(raw.get("eos_token_id"), generation_eos),
            extra={k: v for k, v in raw.items() if k not in _CONSUMED},
        )
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{source}: invalid value: {e}") from None


def token_ids(*values: object) -> tuple[int, ...]:
    """Merge ids given as None, an int or a list of ints into one tuple, first occurrence first."""
    ids: list[int] = []
    for value in values:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and not isinstance(item, bool) and item not in ids:
                ids.append(item)
    return tuple(ids)
