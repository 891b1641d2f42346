"""The Llama decoder (SmolLM2, Llama 2/3, and any Llama-config checkpoint), with the per-head q/k norms that
Qwen3 (``qwen3.py``) turns on.

Plain callables over tensors rather than nn.Modules: inference needs no autograd or module hooks, and a decode
step of a small model is bound by per-op overhead as much as by arithmetic. So q/k/v and gate/up are fused into
one linear each, RoPE rotations are tabulated for every position up to max_model_len, and q/k head dimensions
are stored as (real, imaginary) pairs, which makes RoPE one complex multiply. Attention scores are dot products
over whole heads, so permuting q and k alike leaves them unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor

from pocketllm.rope import rope_frequencies
from pocketllm_torch import fused_ops, native, triton_ops
from pocketllm_torch.attention import AttentionMetadata, paged_attention
from pocketllm_torch.cache_spec import AttentionSpec, LayerCacheSpec
from pocketllm_torch.linear import Fp8Weight, Int4Weight, Int8Weight, Linear, compute_dtype, make_linear, map_rows
from pocketllm_torch.models.weights import Weights, dense
from pocketllm_torch.name import NAME

if TYPE_CHECKING:
    from collections.abc import Iterable

    import numpy as np

    from pocketllm.model_config import ModelConfig
    from pocketllm_torch.context import StepContext
    from pocketllm_torch.groups import Groups

# Old checkpoints store RoPE frequencies as buffers; they are recomputed from the config here.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
T = TypeVar("T", Tensor, Int4Weight, Int8Weight, Fp8Weight)


@dataclass(slots=True)
class RMSNorm:
    """``x / sqrt(mean(x^2) + eps) * weight``, in float32, cast back before the weight as Hugging Face does.

    A decode step of a small model is bound by its number of small ops: float32 rows on CPU go through one
    native kernel (``native.rms_norm``); elsewhere this is four torch kernels, where F.rms_norm runs about seven.
    """

    weight: Tensor
    eps: float
    _eps: Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._eps = torch.tensor(self.eps, device=self.weight.device)  # addcmul's operand: no scalar per call

    def __call__(self, x: Tensor) -> Tensor:
        if triton_ops.use_triton(x):
            return triton_ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps)[0].view(x.shape)
        if (ops := fused_ops.for_tensor(x)) is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        if native.takes_rows(x):
            return native.rms_norm(x, self.weight, self.eps)
        norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
        scale = torch.addcmul(self._eps, norm, norm, value=1 / x.shape[-1]).rsqrt_()
        return torch.mul(x, scale).to(x.dtype).mul_(self.weight)

    def add(self, x: Tensor, delta: Tensor) -> tuple[Tensor, Tensor]:
        """The residual add before this norm, and the norm of its result."""
        if triton_ops.use_triton(x):
            normed, residual = triton_ops.rms_norm(x, self.weight, self.eps, delta)
            return residual, normed
        if (ops := fused_ops.for_tensor(x)) is not None:
            return ops.add_rms_norm(x, delta, self.weight, self.eps)
        if native.takes_rows(x) and native.takes_rows(delta):
            return native.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self(x)


def apply_rope_(x: Tensor, rotation: Tensor) -> None:
    """Rotate x [T, heads, D], head dims in (real, imaginary) pairs, by rotation [T, 1, D/2] (complex), in place."""
    if triton_ops.use_triton(x) and x.stride(-1) == 1:
        angles = rotation.squeeze(1)
        return triton_ops.rotary_(x, angles.real.contiguous(), angles.imag.contiguous(), interleaved=True)
    if (ops := fused_ops.for_tensor(x)) is not None:
        angles = rotation.squeeze(1)
        x.copy_(ops.rotary(x, angles.real, angles.imag, interleaved=True))
        return None
    if x.dtype == torch.float32:
        torch.view_as_complex(x.unflatten(-1, (-1, 2))).mul_(rotation)
    else:
        x.copy_(torch.view_as_real(torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * rotation).flatten(-2))


def _interleave_halves(weight: Tensor, head_dim: int) -> Tensor:
    """Reorder the rows of each head from Llama's (first half, second half) to pairs (x_i, x_{i + D/2})."""
    return weight.unflatten(0, (-1, 2, head_dim // 2)).transpose(1, 2).flatten(0, 2)


@dataclass(slots=True)
class Attention:
    qkv_proj: Linear
    o_proj: Linear
    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_norm: RMSNorm | None  # Qwen3 normalises each head of q and k before RoPE
    k_norm: RMSNorm | None

    def __call__(self, x: Tensor, rotation: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        num_tokens, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        # A fresh tensor in the activations' dtype, rotated in place: k and v then sit side by side for the cache.
        qkv = self.qkv_proj(x).to(x.dtype).view(num_tokens, heads + 2 * kv_heads, dim)
        qk = qkv[:, :heads + kv_heads]
        if self.q_norm is not None and self.k_norm is not None:
            qk[:, :heads] = self.q_norm(qk[:, :heads])
            qk[:, heads:] = self.k_norm(qk[:, heads:])
        apply_rope_(qk, rotation)  # one rotation for q and k together
        kv = qkv[:, heads:].view(num_tokens, 2, kv_heads, dim).permute(1, 2, 0, 3)
        return self.o_proj(paged_attention(qkv[:, :heads], kv, kv_cache, meta, dim ** -0.5))


@dataclass(slots=True)
class MLP:
    gate_up_proj: Linear
    down_proj: Linear

    def __call__(self, x: Tensor) -> Tensor:
        gate_up = self.gate_up_proj(x)
        if triton_ops.use_triton(gate_up):
            return self.down_proj(triton_ops.silu_mul(gate_up))
        if (ops := fused_ops.for_tensor(gate_up)) is not None:
            return self.down_proj(ops.silu_mul(gate_up))
        if native.takes_rows(gate_up):
            return self.down_proj(native.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


@dataclass(slots=True)
class DecoderLayer:
    input_norm: RMSNorm
    attn: Attention
    post_attention_norm: RMSNorm
    mlp: MLP

    def __call__(self, x: Tensor, rotation: Tensor, kv_cache: Tensor, meta: AttentionMetadata) -> Tensor:
        x, h = self.post_attention_norm.add(x, self.attn(self.input_norm(x), rotation, kv_cache, meta))
        return x + self.mlp(h)


@dataclass(slots=True)
class Embedding:
    weight: Tensor  # [vocab, hidden]

    def __call__(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


@dataclass(slots=True)
class LlamaModel:
    embed_tokens: Embedding
    layers: list[DecoderLayer]
    norm: RMSNorm
    lm_head: Linear
    rope: Tensor  # [max_model_len, head_dim / 2] complex: the rotation of each position
    dtype: torch.dtype  # of activations
    cache_specs: list[LayerCacheSpec]  # what each layer keeps per request: paged KV blocks
    QK_NORM: ClassVar[bool] = False  # Qwen3 normalises each head of q and k before RoPE
    # Decode steps may be replayed from traces (decode_graphs.py): the forward is a straight line of tensor ops.
    traceable: ClassVar[bool] = True

    def __call__(self, input_ids: Tensor, ctx: StepContext) -> Tensor:
        """Hidden states [T, hidden] of the step's tokens, before the final norm; fills the KV cache."""
        x = self.embed_tokens(input_ids).to(self.dtype)
        rotation = self.rope[ctx.positions].unsqueeze(1)
        for layer, kv_cache in zip(self.layers, ctx.caches, strict=True):
            x = layer(x, rotation, kv_cache, ctx.attention)
        return x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden)).float()

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: Iterable[tuple[str, np.ndarray | Groups]],
                     device: torch.device, dtype: torch.dtype, max_model_len: int) -> LlamaModel:
        """Build from Hugging Face names and layouts; weights are stored in ``dtype`` on ``device``.

        4- and 8-bit and FP8 matrices (:class:`~pocketllm_torch.groups.Groups`) stay so where a kernel reads them,
        else they are dequantized.
        """
        act_dtype = compute_dtype(device, dtype)

        def rope_layout(name: str, weight: T) -> T:
            if not any(part in name for part in ("q_proj", "k_proj", "q_norm", "k_norm")):
                return weight
            if not isinstance(weight, Tensor):
                return map_rows(weight, lambda rows: _interleave_halves(rows, config.head_dim))
            return _interleave_halves(weight, config.head_dim)

        w = Weights(weights, device, dtype, ignored=_IGNORED, layout=rope_layout)

        def linear(prefix: str, parts: tuple[str, ...], has_bias: bool) -> Linear:
            return w.linear([f"{prefix}.{part}.weight" for part in parts],
                            [f"{prefix}.{part}.bias" for part in parts] if has_bias else ())

        def norm(name: str) -> RMSNorm:
            return RMSNorm(w.dense(name).to(device, act_dtype), config.rms_norm_eps)

        layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}"
            attn = Attention(
                qkv_proj=linear(f"{p}.self_attn", ("q_proj", "k_proj", "v_proj"), config.attention_bias),
                o_proj=linear(f"{p}.self_attn", ("o_proj",), config.attention_bias),
                num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                q_norm=norm(f"{p}.self_attn.q_norm.weight") if cls.QK_NORM else None,
                k_norm=norm(f"{p}.self_attn.k_norm.weight") if cls.QK_NORM else None,
            )
            mlp = MLP(gate_up_proj=linear(f"{p}.mlp", ("gate_proj", "up_proj"), config.mlp_bias),
                      down_proj=linear(f"{p}.mlp", ("down_proj",), config.mlp_bias))
            layers.append(DecoderLayer(norm(f"{p}.input_layernorm.weight"), attn,
                                       norm(f"{p}.post_attention_layernorm.weight"), mlp))

        embed = w.take("model.embed_tokens.weight")
        head = w.pop("lm_head.weight") if config.tie_word_embeddings else w.take("lm_head.weight")
        final_norm = norm("model.norm.weight")
        w.finish()
        inv_freq, attention_factor = rope_frequencies(config, NAME)
        angles = torch.outer(torch.arange(max_model_len, dtype=torch.float32), torch.from_numpy(inv_freq))
        return cls(
            embed_tokens=Embedding(dense(embed, dtype).to(device)),
            layers=layers,
            norm=final_norm,
            lm_head=make_linear(embed if head is None else head, None, device, dtype, out_dtype=torch.float32),
            rope=torch.polar(torch.full_like(angles, attention_factor), angles).to(device),  # YaRN scales cos, sin
            dtype=act_dtype,
            cache_specs=[AttentionSpec(config.num_key_value_heads, config.head_dim)] * config.num_hidden_layers,
        )
