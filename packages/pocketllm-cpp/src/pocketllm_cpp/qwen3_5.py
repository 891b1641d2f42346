"""Qwen3.5 (dense and MoE) for the native model: the checkpoint's tensors as typed layer structs, matrices in their
file bytes. Names as the core gives them: Hugging Face's, except the GGUF tensors llama.cpp's converter changed
(norms stored as 1 + w, ssm_a = -exp(A_log), the convolution squeezed, value heads tiled), which keep their
GGUF names."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from pocketllm.errors import CheckpointError
from pocketllm.rope import rope_frequencies
from pocketllm_cpp import _native
from pocketllm_cpp.loading import Tensors, tensor_of, vector
from pocketllm_cpp.name import NAME

if TYPE_CHECKING:
    from pocketllm.checkpoint import Checkpoint
    from pocketllm.model_config import ModelConfig
    from pocketllm_cpp.loading import BuildOptions

_HF = {"input_norm": "model.layers.{i}.input_layernorm.weight",
       "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
       "q_norm": "model.layers.{i}.self_attn.q_norm.weight", "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
       "final_norm": "model.norm.weight",
       "qkv": "model.layers.{i}.linear_attn.in_proj_qkv.weight", "z": "model.layers.{i}.linear_attn.in_proj_z.weight",
       "b": "model.layers.{i}.linear_attn.in_proj_b.weight", "a": "model.layers.{i}.linear_attn.in_proj_a.weight",
       "conv": "model.layers.{i}.linear_attn.conv1d.weight", "decay": "model.layers.{i}.linear_attn.A_log",
       "dt_bias": "model.layers.{i}.linear_attn.dt_bias", "out": "model.layers.{i}.linear_attn.out_proj.weight"}
_GGUF = {"input_norm": "blk.{i}.attn_norm.weight", "post_norm": "blk.{i}.post_attention_norm.weight",
         "q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight",
         "final_norm": "output_norm.weight",
         "qkv": "blk.{i}.attn_qkv.weight", "z": "blk.{i}.attn_gate.weight", "b": "blk.{i}.ssm_beta.weight",
         "a": "blk.{i}.ssm_alpha.weight", "conv": "blk.{i}.ssm_conv1d.weight", "decay": "blk.{i}.ssm_a",
         "dt_bias": "blk.{i}.ssm_dt.bias", "out": "blk.{i}.ssm_out.weight"}
_SIZES = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
          "linear_conv_kernel_dim")


def layer_types(config: ModelConfig) -> list[str]:
    """'linear_attention' or 'full_attention' per layer (every full_attention_interval-th one without a list)."""
    types = config.extra.get("layer_types")
    if types is None:
        interval = config.extra.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers or set(types) - {"linear_attention", "full_attention"}:
        raise CheckpointError(f"layer_types must name linear_attention or full_attention for each of the "
                              f"{config.num_hidden_layers} layers, got {types!r}")
    return list(types)


def linear_sizes(config: ModelConfig) -> tuple[int, int, int, int, int]:
    """Key heads, value heads, key and value head sizes, and conv kernel of the Gated DeltaNet layers."""
    extra = config.extra
    for key in _SIZES:
        if not isinstance(extra.get(key), int) or isinstance(extra[key], bool) or extra[key] <= 0:
            raise CheckpointError(f"config {key!r} must be a positive integer, got {extra.get(key)!r}")
    hk, hv, dk, dv, kernel = (extra[key] for key in _SIZES)
    return hk, hv, dk, dv, kernel


def state_slot_bytes(config: ModelConfig) -> int:
    """One request's state: per Gated DeltaNet layer the conv's last kernel-1 inputs [kernel-1, channels], then
    [Hv, dk, dv]."""
    hk, hv, dk, dv, kernel = linear_sizes(config)
    per_layer = (2 * hk * dk + hv * dv) * (kernel - 1) + hv * dk * dv
    return 4 * per_layer * layer_types(config).count("linear_attention")


def num_attention_layers(config: ModelConfig) -> int:
    return layer_types(config).count("full_attention")


def build(checkpoint: Checkpoint, options: BuildOptions) -> _native.Model:
    config = checkpoint.config
    hk, hv, dk, dv, kernel = linear_sizes(config)
    if hv % hk:
        raise CheckpointError(f"linear_num_value_heads {hv} is not a multiple of linear_num_key_heads {hk}")
    tensors = Tensors(checkpoint.path, list(checkpoint.tensors()))  # the MTP head's are apart: mtp_tensors()
    gguf = tensors.has(_GGUF["final_norm"])
    read = _Layers(checkpoint, tensors, gguf)
    layers = [read.layer(f"model.layers.{i}", i, kind) for i, kind in enumerate(layer_types(config))]
    embedding = tensors.matrix("model.embed_tokens.weight")
    if config.tie_word_embeddings and not tensors.has("lm_head.weight"):
        lm_head = embedding
    else:
        lm_head = tensors.matrix("lm_head.weight")
    final_norm = read.norm((_GGUF if gguf else _HF)["final_norm"])
    dim = config.head_dim
    rotary = int(dim * config.extra.get("partial_rotary_factor", 1.0))
    inv_freq, attention = rope_frequencies(config, NAME, rotary)
    c = _native.Qwen3_5Config()
    c.vocab_size, c.hidden_size, c.num_layers = config.vocab_size, config.hidden_size, config.num_hidden_layers
    c.num_heads, c.num_kv_heads, c.head_dim = config.num_attention_heads, config.num_key_value_heads, dim
    c.rotary_dim, c.rms_norm_eps, c.inv_freq, c.rope_attention_factor = rotary, config.rms_norm_eps, \
        inv_freq.tolist(), attention
    c.linear_num_k_heads, c.linear_num_v_heads, c.linear_k_dim, c.linear_v_dim, c.conv_kernel = hk, hv, dk, dv, kernel
    c.tiled_heads = gguf and hv > hk  # llama.cpp's converter reorders the value heads
    c.exact_activations, c.kv_cache_dtype = options.exact_activations, options.kv_cache_dtype
    head = _mtp_head(checkpoint) if options.mtp else None
    return _native.qwen3_5_model(c, embedding, layers, final_norm, lm_head, options.num_blocks, options.block_size,
                                 options.num_state_slots, options.num_threads, head)


# The multi-token-prediction head's own tensors (see Checkpoint.mtp_tensors): Hugging Face's, and the GGUF names of
# llama.cpp's converter, whose layer is blk.<n> for n the model's layer count.
_MTP_HF = {"fc": "mtp.fc.weight", "embedding_norm": "mtp.pre_fc_norm_embedding.weight",
           "hidden_norm": "mtp.pre_fc_norm_hidden.weight", "norm": "mtp.norm.weight"}
_MTP_GGUF = {"fc": "blk.{n}.nextn.eh_proj.weight", "embedding_norm": "blk.{n}.nextn.enorm.weight",
             "hidden_norm": "blk.{n}.nextn.hnorm.weight", "norm": "blk.{n}.nextn.shared_head_norm.weight"}


def _mtp_head(checkpoint: Checkpoint) -> _native.Qwen3_5MTP:
    """Qwen3.5's head, one full-attention layer of the model's kind between its projection and its norm."""
    tensors = Tensors(checkpoint.path, checkpoint.mtp_tensors())
    gguf = not tensors.has(_MTP_HF["fc"])
    n = checkpoint.config.num_hidden_layers
    names = {part: name.format(n=n) for part, name in (_MTP_GGUF if gguf else _MTP_HF).items()}
    read = _Layers(checkpoint, tensors, gguf)
    head = _native.Qwen3_5MTP()
    head.fc = tensors.matrix(names["fc"])
    head.embedding_norm, head.hidden_norm, head.norm = (read.norm(names[part])
                                                        for part in ("embedding_norm", "hidden_norm", "norm"))
    head.layer = read.layer(f"model.layers.{n}" if gguf else "mtp.layers.0", n, "full_attention")
    tensors.finish()
    return head


class _Layers:
    """Reads Qwen3.5 layers from tensors named as the core names them (Hugging Face's, or GGUF's where the converter
    changed the values: see the module docstring)."""

    def __init__(self, checkpoint: Checkpoint, tensors: Tensors, gguf: bool) -> None:
        self.checkpoint, self.tensors, self.gguf = checkpoint, tensors, gguf

    def norm(self, name: str) -> list[float]:
        weight = vector(self.tensors.take(name))
        return (weight if self.gguf else 1 + weight).tolist()  # zero-centred: applied as 1 + w

    def layer(self, p: str, i: int, kind: str) -> _native.Qwen3_5Layer:
        """Layer ``i``: its Hugging Face-named tensors under ``p``, its GGUF-named ones under ``blk.<i>``."""
        config, tensors = self.checkpoint.config, self.tensors

        def name(part: str) -> str:
            return _GGUF[part].format(i=i) if self.gguf else _HF[part].replace("model.layers.{i}", p)

        layer = _native.Qwen3_5Layer()
        layer.kind = kind
        layer.input_norm, layer.post_attention_norm = self.norm(name("input_norm")), self.norm(name("post_norm"))
        if kind == "full_attention":
            a = f"{p}.self_attn"
            layer.q, layer.k, layer.v, layer.o = (tensors.matrix(f"{a}.{m}.weight")
                                                  for m in ("q_proj", "k_proj", "v_proj", "o_proj"))
            layer.q_norm, layer.k_norm = self.norm(name("q_norm")), self.norm(name("k_norm"))
        else:
            hk, hv, dk, dv, kernel = linear_sizes(config)
            channels = 2 * hk * dk + hv * dv
            layer.qkv, layer.z, layer.b, layer.a, layer.out = (tensors.matrix(name(m))
                                                              for m in ("qkv", "z", "b", "a", "out"))
            conv = vector(tensors.take(name("conv")))
            if conv.size != channels * kernel:
                raise CheckpointError(f"{self.checkpoint.path}: {name('conv')} has {conv.size} values, expected "
                                      f"{channels} channels x {kernel}")
            layer.conv = conv.tolist()
            decay = vector(tensors.take(name("decay")))
            layer.decay = (decay if self.gguf else -np.exp(decay)).tolist()
            layer.dt_bias = vector(tensors.take(name("dt_bias"))).tolist()
            layer.norm = vector(tensors.take(f"{p}.linear_attn.norm.weight")).tolist()
        if "num_experts" in config.extra:
            _moe(layer, tensors, f"{p}.mlp", config.extra)
        else:
            layer.gate, layer.up, layer.down = (tensors.matrix(f"{p}.mlp.{m}.weight")
                                                for m in ("gate_proj", "up_proj", "down_proj"))
        return layer


def _moe(layer: _native.Qwen3_5Layer, tensors: Tensors, prefix: str, extra: dict[str, object]) -> None:
    experts = f"{prefix}.experts"
    layer.router = tensors.matrix(f"{prefix}.gate.weight")
    if tensors.has(f"{experts}.gate_up_proj"):  # transformers' fused layout
        layer.experts_gate_up = tensor_of(tensors.take(f"{experts}.gate_up_proj"))
        layer.experts_down = [tensor_of(tensors.take(f"{experts}.down_proj"))]
    elif tensors.has(f"{experts}.down_proj.weight"):  # GGUF: stacked [experts, out, in]
        layer.experts_gate, layer.experts_up, layer.experts_down = (
            [tensor_of(tensors.take(f"{experts}.{m}.weight"))] for m in ("gate_proj", "up_proj", "down_proj"))
    else:  # a matrix per expert
        count = extra.get("num_experts")
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            raise CheckpointError(f"config 'num_experts' must be a positive integer, got {count!r}")
        layer.experts_gate, layer.experts_up, layer.experts_down = (
            [tensors.matrix(f"{experts}.{e}.{m}.weight") for e in range(count)]
            for m in ("gate_proj", "up_proj", "down_proj"))
    shared = f"{prefix}.shared_expert"
    if tensors.has(f"{shared}.gate_proj.weight"):
        layer.shared_gate, layer.shared_up, layer.shared_down = (
            tensors.matrix(f"{shared}.{m}.weight") for m in ("gate_proj", "up_proj", "down_proj"))
        layer.shared_expert_gate = tensors.matrix(f"{prefix}.shared_expert_gate.weight")
    top_k = extra.get("num_experts_per_tok")
    if not isinstance(top_k, int) or isinstance(top_k, bool):
        raise CheckpointError(f"config 'num_experts_per_tok' must be an integer, got {top_k!r}")
    layer.top_k = top_k
    layer.norm_topk_prob = bool(extra.get("norm_topk_prob", True))
