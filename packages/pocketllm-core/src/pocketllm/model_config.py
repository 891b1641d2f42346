"""One normalised model description, whatever checkpoint format it came from."""

from __future__ import annotations

import msgspec


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Architecture hyper-parameters in Hugging Face terms.

    ``architecture`` is a lower-case family name ("llama", "qwen3", ...).
    Weights from any format are named and laid out as in the Hugging Face
    checkpoint of that family (e.g. ``model.layers.0.self_attn.q_proj.weight``,
    shape ``[out_features, in_features]``).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    # The dense MLP's width; 0 for a model without one (Qwen3.5 MoE: every layer is a mixture of experts, sized
    # by extra's moe_intermediate_size, and transformers' config class has no intermediate_size).
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Keys of the source config that have no field above, kept for backends
    # of newer architectures (e.g. Qwen3.5's linear-attention settings).
    extra: dict = msgspec.field(default_factory=dict)
