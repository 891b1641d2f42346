"""Qwen3.5, dense and MoE: a hybrid of Gated DeltaNet layers (linear attention with a fixed-size state per
request) and gated full-attention layers over the paged KV cache, three to one by default.

Plain torch, after transformers' ``qwen3_5`` and ``qwen3_5_moe``. Per layer type:

- Gated DeltaNet: one projection into (q, k, v) for a depthwise causal convolution, the output gate z and the
  delta rule's beta and decay logits; SiLU after the convolution; q and k L2-normalised (q also scaled by
  dk^-0.5) and repeated over the value heads when Hv > Hk; the gated delta rule with its state in float32,
  chunked for prefill and recurrent for decode; a gated RMSNorm ``norm(o) * w * silu(z)``.
- Gated attention: ``q_proj`` yields, per head, the query and an output gate ``sigmoid(gate)``; q/k RMSNorm per
  head; RoPE on the first ``partial_rotary_factor`` of each head, rotate-half style. For text alone the t, h
  and w positions of MRoPE are equal, which makes it this plain partial RoPE.
- Norms are zero-centred, ``norm(x) * (1 + w)``: the 1 is added to the weights at load.
- MoE layers route each token to its top-k experts (softmax, renormalised over the k), computed expert by
  expert over the tokens routed to it, plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from pocketllm.errors import CheckpointError
from pocketllm.rope import rope_frequencies
from pocketllm_torch import fused_ops, native, triton_ops
from pocketllm_torch.attention import paged_attention
from pocketllm_torch.cache_spec import AttentionSpec, LayerCacheSpec, StateSpec
from pocketllm_torch.linear import Fp8Weight, Linear, compute_dtype, make_linear
from pocketllm_torch.models.llama import MLP, Embedding, RMSNorm
from pocketllm_torch.models.weights import Weights, dense
from pocketllm_torch.name import NAME

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    import numpy as np

    from pocketllm.model_config import ModelConfig
    from pocketllm_torch.context import StepContext
    from pocketllm_torch.groups import Groups
    from pocketllm_torch.state_cache import LayerState

# RoPE buffers of old checkpoints. (The multi-token-prediction head's tensors come apart: qwen3_5_mtp.py.)
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")
# A GGUF file keeps llama.cpp's names for the tensors its converter changed (the core reader renames only those
# it left alone): the norms are stored as 1 + w, ssm_a = -exp(A_log), the convolution squeezed to [channels,
# kernel], and, where Hv > Hk, the value heads tiled (see GatedDeltaNet.tiled_heads). Per part of layer {i}:
_HF_NAMES = {
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight", "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "final_norm": "model.norm.weight",
    "qkv": "model.layers.{i}.linear_attn.in_proj_qkv.weight", "z": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "b": "model.layers.{i}.linear_attn.in_proj_b.weight", "a": "model.layers.{i}.linear_attn.in_proj_a.weight",
    "conv": "model.layers.{i}.linear_attn.conv1d.weight", "decay": "model.layers.{i}.linear_attn.A_log",
    "dt_bias": "model.layers.{i}.linear_attn.dt_bias", "out": "model.layers.{i}.linear_attn.out_proj.weight",
}
_GGUF_NAMES = {
    "input_norm": "blk.{i}.attn_norm.weight", "post_norm": "blk.{i}.post_attention_norm.weight",
    "q_norm": "blk.{i}.attn_q_norm.weight", "k_norm": "blk.{i}.attn_k_norm.weight", "final_norm": "output_norm.weight",
    "qkv": "blk.{i}.attn_qkv.weight", "z": "blk.{i}.attn_gate.weight", "b": "blk.{i}.ssm_beta.weight",
    "a": "blk.{i}.ssm_alpha.weight", "conv": "blk.{i}.ssm_conv1d.weight", "decay": "blk.{i}.ssm_a",
    "dt_bias": "blk.{i}.ssm_dt.bias", "out": "blk.{i}.ssm_out.weight",
}
CHUNK = 64  # tokens per chunk of the chunked delta rule, as transformers and flash-linear-attention use


def layer_types(config: ModelConfig) -> list[str]:
    """'linear_attention' or 'full_attention' per layer: the config's list, else every ``full_attention_interval``-th
    layer (4 by default) is full attention."""
    types = config.extra.get("layer_types")
    if types is None:
        interval = config.extra.get("full_attention_interval", 4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(config.num_hidden_layers)]
    if len(types) != config.num_hidden_layers or set(types) - {"linear_attention", "full_attention"}:
        raise CheckpointError(f"layer_types must name linear_attention or full_attention for each of the "
                              f"{config.num_hidden_layers} layers, got {types!r}")
    return list(types)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                           keep: Sequence[int] = ()) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The gated delta rule over one sequence's n tokens, a chunk of CHUNK tokens at a time, from ``state``.

    q, k [n, H, dk] (normalised and scaled), v [n, H, dv], g (log decay) and beta [n, H], state [H, dk, dv]; all
    float32. Returns the outputs [n, H, dv], the state after the last token, and the states after each chunk
    index in ``keep`` (for prefix-cache snapshots inside a prompt chunk). Within a chunk the sequential
    updates are one triangular solve (the UT transform of DeltaNet); chunks run in turn, each from the state the
    one before left.
    """
    n = q.shape[0]
    pad = -n % CHUNK
    q, k, v = (F.pad(t.transpose(0, 1), (0, 0, 0, pad)).unflatten(1, (-1, CHUNK)) for t in (q, k, v))
    g, beta = (F.pad(t.transpose(0, 1), (0, pad)).unflatten(1, (-1, CHUNK)) for t in (g, beta))  # [H, C, CHUNK]
    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each position
    later = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(later, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # unit lower triangular once solved: the diagonal is 1
    new_values = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pairwise
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]
    out = torch.empty_like(new_values)
    kept = []
    for c in range(q.shape[1]):
        correction = new_values[:, c] - k_decayed[:, c] @ state
        out[:, c] = q[:, c] @ state + intra[:, c] @ correction
        state = state * chunk_decay[:, c] + k[:, c].transpose(-1, -2) @ correction
        if c in keep:
            kept.append(state)
    return out.flatten(1, 2)[:, :n].transpose(0, 1), state, kept


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                               state: Tensor) -> tuple[Tensor, Tensor]:
    """One token of each of B sequences: q, k [B, H, dk], v [B, H, dv], g and beta [B, H], state [B, H, dk, dv]."""
    state = state * g.exp()[..., None, None]
    remembered = torch.einsum("bhk,bhkv->bhv", k, state)
    state = state + k[..., None] * ((v - remembered) * beta[..., None])[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def verify_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                            state: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
    """A few tokens of one sequence, one at a time (q, k [T, H, dk], v [T, H, dv], g and beta [T, H], state
    [H, dk, dv]): the outputs [T, H, dv], the final state, and the states after rows 1..T-1."""
    outs, kept = [], []
    state = state.unsqueeze(0)
    for t in range(q.shape[0]):
        if t:
            kept.append(state[0])
        out, state = recurrent_gated_delta_rule(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], state)
        outs.append(out)
    return torch.cat(outs), state[0], kept


@dataclass(slots=True)
class GatedRMSNorm:
    weight: Tensor
    eps: float

    def __call__(self, x: Tensor, gate: Tensor) -> Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


@dataclass(slots=True)
class GatedDeltaNet:
    in_proj: Linear  # rows: q, k, v (the convolution's channels), then z, beta logits, decay logits
    conv_weight: Tensor  # [channels, kernel]
    decay_rate: Tensor  # -exp(A_log) [Hv], float32
    dt_bias: Tensor  # [Hv], float32
    norm: GatedRMSNorm
    out_proj: Linear
    num_k_heads: int
    num_v_heads: int
    k_dim: int
    v_dim: int
    # Value head h reads key head h // (Hv / Hk) (Hugging Face's grouped order), or h % Hk (llama.cpp's GGUF
    # files, whose converter reorders the value heads so that its kernels can broadcast keys by tiling).
    tiled_heads: bool = False

    def __call__(self, x: Tensor, rope: tuple[Tensor, Tensor], state: LayerState, ctx: StepContext) -> Tensor:
        hv, dv = self.num_v_heads, self.v_dim
        channels = self.conv_weight.shape[0]
        proj = self.in_proj(x)
        assert ctx.state_slots is not None
        if ctx.is_decode and native.takes_rows(proj):
            out = native.gated_delta_decode(proj, state.conv, state.recurrent, ctx.state_slots, self.conv_weight,
                                            self.decay_rate, self.dt_bias, self.norm.weight, self.num_k_heads,
                                            self.tiled_heads, self.norm.eps)
            return self.out_proj(out)
        mixed, z, b, a = proj.split([channels, hv * dv, hv, hv], dim=-1)
        beta = b.float().sigmoid()
        g = self.decay_rate * F.softplus(a.float() + self.dt_bias)
        if ctx.is_decode and triton_ops.use_triton(proj):  # the slots' states updated in place by the kernels
            q, k, v = self._heads(triton_ops.conv_update(mixed, state.conv, ctx.state_slots, self.conv_weight))
            out = triton_ops.delta_step(q, k, v, g, beta, state.recurrent, ctx.state_slots)
        elif ctx.is_decode:
            # index_select / index_copy_ rather than indexing: decode traces record these in-place writes.
            slots = ctx.state_slots
            q, k, v = self._heads(self._conv_step(mixed, state.conv, slots))
            out, recurrent = recurrent_gated_delta_rule(q, k, v, g, beta, state.recurrent.index_select(0, slots))
            state.recurrent.index_copy_(0, slots, recurrent)
        else:
            outs, start = [], 0
            for i, (n, slot) in enumerate(zip(ctx.query_lens, ctx.state_slots.tolist(), strict=True)):
                window = self._conv_window(mixed[start:start + n], state.conv, slot)
                q, k, v = self._heads(self._conv(window))
                width = state.conv.shape[-1]
                if i in ctx.verifying:  # a token and its drafts: the state after each row, for the accepted one
                    out, state.recurrent[slot], kept = verify_gated_delta_rule(
                        q, k, v, g[start:start + n], beta[start:start + n], state.recurrent[slot])
                    for p, recurrent in enumerate(kept, 1):
                        ctx.kept.setdefault((i, p), []).append((window[:, p:p + width], recurrent))
                else:
                    points = ctx.capture_points[i] if ctx.capture_points else []
                    out, state.recurrent[slot], kept = chunk_gated_delta_rule(
                        q, k, v, g[start:start + n], beta[start:start + n], state.recurrent[slot],
                        keep=[p // CHUNK - 1 for p in points])
                    for p, recurrent in zip(points, kept, strict=True):  # the conv state after p of the n inputs
                        ctx.captured.setdefault((i, p), []).append((window[:, p:p + width], recurrent))
                outs.append(out)
                start += n
            out = torch.cat(outs)
        out = self.norm(out.to(x.dtype).reshape(-1, dv), z.reshape(-1, dv))
        return self.out_proj(out.view(x.shape[0], hv * dv))

    def _conv_step(self, mixed: Tensor, conv: Tensor, slots: Tensor) -> Tensor:
        """One new input per sequence: the window of its last kernel-size inputs, and the window moves on."""
        window = torch.cat([conv.index_select(0, slots), mixed.unsqueeze(-1).to(conv.dtype)], dim=-1)
        conv.index_copy_(0, slots, window[..., 1:])  # [B, channels, kernel]: the window moves on
        return F.silu((window * self.conv_weight).sum(-1))

    @staticmethod
    def _conv_window(mixed: Tensor, conv: Tensor, slot: int) -> Tensor:
        """A chunk of one sequence's inputs [n, channels] after the inputs its state keeps (zeros at the start),
        as [channels, kernel - 1 + n]; the state moves on to the window's end."""
        window = torch.cat([conv[slot], mixed.t().to(conv.dtype)], dim=-1)
        conv[slot] = window[:, window.shape[1] - conv.shape[-1]:]
        return window

    def _conv(self, window: Tensor) -> Tensor:
        out = F.conv1d(window.unsqueeze(0), self.conv_weight.unsqueeze(1), groups=window.shape[0])[0]
        return F.silu(out.t())

    def _heads(self, mixed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k [T, Hv, dk] (normalised, q scaled, each key head repeated over its value heads), v [T, Hv, dv]."""
        hk, hv, dk = self.num_k_heads, self.num_v_heads, self.k_dim
        q, k, v = mixed.float().split([hk * dk, hk * dk, hv * self.v_dim], dim=-1)
        q, k = (l2norm(t.unflatten(-1, (hk, dk))) for t in (q, k))
        if self.tiled_heads:
            q, k = q.repeat(1, hv // hk, 1), k.repeat(1, hv // hk, 1)
        else:
            q, k = q.repeat_interleave(hv // hk, dim=-2), k.repeat_interleave(hv // hk, dim=-2)
        return q * dk ** -0.5, k, v.unflatten(-1, (hv, self.v_dim))


def rotate_partial(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on the first ``cos.shape[-1]`` dimensions of each head, rotate-half style; the rest pass through."""
    width = cos.shape[-1]
    if triton_ops.use_triton(x):  # cos and sin [T, 1, width]: each half's angles twice
        x = x.clone()
        triton_ops.rotary_(x, cos[:, 0, :width // 2].contiguous(), sin[:, 0, :width // 2].contiguous(),
                           interleaved=False)
        return x
    rotated, rest = x[..., :width], x[..., width:]
    if (ops := fused_ops.for_tensor(x)) is not None:
        return torch.cat([ops.rotary(rotated, cos[:, 0, :width // 2], sin[:, 0, :width // 2], interleaved=False),
                          rest], dim=-1)
    first, second = rotated.chunk(2, dim=-1)
    return torch.cat([rotated * cos + torch.cat([-second, first], dim=-1) * sin, rest], dim=-1)


@dataclass(slots=True)
class GatedAttention:
    qkv_proj: Linear  # rows: per head its query and output gate, then k, then v
    o_proj: Linear
    q_norm: RMSNorm
    k_norm: RMSNorm
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __call__(self, x: Tensor, rope: tuple[Tensor, Tensor], kv_cache: Tensor, ctx: StepContext) -> Tensor:
        t, heads, kv_heads, dim = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        query_gate, k, v = self.qkv_proj(x).to(x.dtype).split([2 * heads * dim, kv_heads * dim, kv_heads * dim], -1)
        q, gate = query_gate.view(t, heads, 2 * dim).chunk(2, dim=-1)
        cos, sin = rope
        q = rotate_partial(self.q_norm(q.contiguous()), cos, sin)
        k = rotate_partial(self.k_norm(k.view(t, kv_heads, dim)), cos, sin)
        kv = torch.stack([k, v.view(t, kv_heads, dim)]).transpose(1, 2)  # [2, kv heads, T, D]
        out = paged_attention(q, kv, kv_cache, ctx.attention, dim ** -0.5)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, heads * dim)))


@dataclass(slots=True)
class StackedExperts:
    """Every expert's weights in two stacked tensors."""

    gate_up: Tensor  # [experts, 2 * intermediate, hidden]
    down: Tensor  # [experts, hidden, intermediate]

    def __call__(self, expert: int, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.gate_up[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[expert])


@dataclass(slots=True)
class LinearExperts:
    """Each expert's projections as linear layers of their own: FP8 experts stay FP8 (``linear.Fp8Linear``)."""

    gate_up: list[Linear]
    down: list[Linear]

    def __call__(self, expert: int, x: Tensor) -> Tensor:
        gate, up = self.gate_up[expert](x).chunk(2, dim=-1)
        return self.down[expert](F.silu(gate) * up)


@dataclass(slots=True)
class SparseMoE:
    router: Tensor  # [experts, hidden]
    experts: StackedExperts | LinearExperts
    top_k: int
    renormalize: bool  # the top-k probabilities rescaled to sum to 1
    shared_expert: MLP
    shared_gate: Tensor  # [1, hidden]

    def __call__(self, x: Tensor) -> Tensor:
        probs = torch.softmax(F.linear(x, self.router).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        # Token-expert pairs grouped by expert: each expert multiplies the rows routed to it in one matmul.
        order = experts.flatten().argsort(stable=True)
        tokens, pair_weights = order // self.top_k, weights.flatten()[order].to(x.dtype)
        counts = torch.bincount(experts.flatten(), minlength=self.router.shape[0]).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start:start + count]
            routed = self.experts(expert, x[rows]) * pair_weights[start:start + count, None]
            out.index_add_(0, rows, routed)
            start += count
        return out + torch.sigmoid(F.linear(x, self.shared_gate)) * self.shared_expert(x)


@dataclass(slots=True)
class HybridLayer:
    input_norm: RMSNorm
    mixer: GatedDeltaNet | GatedAttention
    post_attention_norm: RMSNorm
    mlp: MLP | SparseMoE


@dataclass(slots=True)
class Qwen3_5Model:
    embed_tokens: Embedding
    layers: list[HybridLayer]
    norm: RMSNorm
    lm_head: Linear
    cos: Tensor  # [max_model_len, rotary dims]: rotate-half tables of each position
    sin: Tensor
    dtype: torch.dtype  # of activations
    cache_specs: list[LayerCacheSpec]
    # Decode steps may be replayed from traces (decode_graphs.py) unless experts are routed: their token counts
    # steer Python, which a trace would freeze.
    traceable: bool
    # Inside a prompt chunk, states exist after every CHUNK tokens: where prefix-cache snapshots can be taken.
    STATE_CAPTURE_INTERVAL: ClassVar[int] = CHUNK

    def __call__(self, input_ids: Tensor, ctx: StepContext) -> Tensor:
        """Hidden states [T, hidden] of the step's tokens, before the final norm; updates KV and states."""
        x = self.embed_tokens(input_ids).to(self.dtype)
        rope = self.cos[ctx.positions].unsqueeze(1), self.sin[ctx.positions].unsqueeze(1)
        for layer, cache in zip(self.layers, ctx.caches, strict=True):
            x, h = layer.post_attention_norm.add(x, layer.mixer(layer.input_norm(x), rope, cache, ctx))
            x = x + layer.mlp(h)
        return x

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.lm_head(self.norm(hidden)).float()

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: Iterable[tuple[str, np.ndarray | Groups]],
                     device: torch.device, dtype: torch.dtype, max_model_len: int) -> Qwen3_5Model:
        w = Weights(weights, device, dtype, ignored=_IGNORED)
        load = LayerLoader(w, config, device, dtype)
        layers, specs = [], []
        for i, kind in enumerate(layer_types(config)):
            layers.append(load.layer(f"model.layers.{i}", i, kind))
            specs.append(StateSpec(*load.state_shapes()) if kind == "linear_attention"
                         else AttentionSpec(config.num_key_value_heads, config.head_dim))
        embed = w.take("model.embed_tokens.weight")
        head = w.pop("lm_head.weight") if config.tie_word_embeddings else w.take("lm_head.weight")
        final_norm = load.norm(load.name("final_norm"))
        w.finish()
        act_dtype, dim = load.act_dtype, config.head_dim
        rotary = int(dim * config.extra.get("partial_rotary_factor", 1.0))
        inv_freq, attention_factor = rope_frequencies(config, NAME, rotary)
        angles = torch.outer(torch.arange(max_model_len, dtype=torch.float32), torch.from_numpy(inv_freq))
        angles = torch.cat([angles, angles], dim=-1)
        return cls(
            embed_tokens=Embedding(dense(embed, dtype).to(device)),
            layers=layers,
            norm=final_norm,
            lm_head=make_linear(embed if head is None else head, None, device, dtype, out_dtype=torch.float32),
            cos=(angles.cos() * attention_factor).to(device, act_dtype),
            sin=(angles.sin() * attention_factor).to(device, act_dtype),
            dtype=act_dtype,
            cache_specs=specs,
            traceable=not load.is_moe,
        )


class LayerLoader:
    """Builds Qwen3.5's layers from a checkpoint's weights, in Hugging Face or GGUF naming (see _GGUF_NAMES): the
    model's own and those of its multi-token-prediction head (qwen3_5_mtp.py), which are built alike."""

    def __init__(self, w: Weights, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        self.w, self.config, self.device = w, config, device
        self.act_dtype = compute_dtype(device, dtype)
        self.gguf = w.has(_GGUF_NAMES["final_norm"])
        self.is_moe = "num_experts" in config.extra
        extra = config.extra
        sizes = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_conv_kernel_dim")
        for key in sizes:
            if not isinstance(extra.get(key), int) or isinstance(extra[key], bool) or extra[key] <= 0:
                raise CheckpointError(f"config {key!r} must be a positive integer, got {extra.get(key)!r}")
        self.hk, self.hv, self.dk, self.dv, self.kernel = (extra[key] for key in sizes)
        if self.hv % self.hk:
            raise CheckpointError(f"linear_num_value_heads {self.hv} is not a multiple of linear_num_key_heads "
                                  f"{self.hk}")

    def name(self, part: str, layer: int = 0) -> str:
        return (_GGUF_NAMES if self.gguf else _HF_NAMES)[part].format(i=layer)

    def norm(self, name: str) -> RMSNorm:
        """A zero-centred norm: GGUF files store its weight as 1 + w already."""
        weight = self.w.dense(name).float()
        return RMSNorm((weight if self.gguf else 1 + weight).to(self.device, self.act_dtype), self.config.rms_norm_eps)

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """A Gated DeltaNet layer's conv state [channels, kernel - 1] and recurrent state [Hv, dk, dv]."""
        return (2 * self.hk * self.dk + self.hv * self.dv, self.kernel - 1), (self.hv, self.dk, self.dv)

    def layer(self, prefix: str, i: int, kind: str) -> HybridLayer:
        """Layer ``i``, its Hugging Face-named tensors under ``prefix`` (``model.layers.3``), its GGUF-named ones
        under ``blk.<i>``."""
        def norm(part: str, hf: str) -> RMSNorm:
            return self.norm(self.name(part, i) if self.gguf else f"{prefix}.{hf}")

        mixer: GatedDeltaNet | GatedAttention
        if kind == "linear_attention":
            mixer = self._gated_delta_net(prefix, i)
        else:
            a = f"{prefix}.self_attn"
            mixer = GatedAttention(
                qkv_proj=self.w.linear([f"{a}.{part}.weight" for part in ("q_proj", "k_proj", "v_proj")]),
                o_proj=self.w.linear([f"{a}.o_proj.weight"]),
                q_norm=norm("q_norm", "self_attn.q_norm.weight"), k_norm=norm("k_norm", "self_attn.k_norm.weight"),
                num_heads=self.config.num_attention_heads, num_kv_heads=self.config.num_key_value_heads,
                head_dim=self.config.head_dim)
        return HybridLayer(norm("input_norm", "input_layernorm.weight"), mixer,
                           norm("post_norm", "post_attention_layernorm.weight"),
                           self._moe(f"{prefix}.mlp") if self.is_moe else self._mlp(f"{prefix}.mlp"))

    def _gated_delta_net(self, prefix: str, i: int) -> GatedDeltaNet:
        hk, hv, dk, dv, kernel = self.hk, self.hv, self.dk, self.dv, self.kernel
        w, name, device, act_dtype = self.w, self.name, self.device, self.act_dtype
        decay = w.dense(name("decay", i)).float()
        return GatedDeltaNet(
            in_proj=w.linear([name(part, i) for part in ("qkv", "z", "b", "a")]),
            conv_weight=w.dense(name("conv", i)).reshape(2 * hk * dk + hv * dv, kernel).to(device, act_dtype),
            decay_rate=(decay if self.gguf else -decay.exp()).to(device),
            dt_bias=w.dense(name("dt_bias", i)).float().to(device),
            norm=GatedRMSNorm(w.dense(f"{prefix}.linear_attn.norm.weight").to(device, act_dtype),
                              self.config.rms_norm_eps),
            out_proj=w.linear([name("out", i)]),
            num_k_heads=hk, num_v_heads=hv, k_dim=dk, v_dim=dv, tiled_heads=self.gguf and hv > hk)

    def _mlp(self, prefix: str) -> MLP:
        return MLP(self.w.linear([f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"]),
                   self.w.linear([f"{prefix}.down_proj.weight"]))

    def _stacked(self, prefix: str, part: str) -> Tensor:
        if self.w.has(f"{prefix}.{part}.weight"):  # GGUF: stacked [experts, out, in]
            return self.w.dense(f"{prefix}.{part}.weight")
        return torch.stack([self.w.dense(f"{prefix}.{e}.{part}.weight")
                            for e in range(self.config.extra["num_experts"])])

    def _experts(self, experts: str) -> StackedExperts | LinearExperts:
        w, device, act_dtype = self.w, self.device, self.act_dtype
        if w.has(f"{experts}.gate_up_proj"):  # transformers' fused layout
            gate_up, down = w.dense(f"{experts}.gate_up_proj"), w.dense(f"{experts}.down_proj")
        elif isinstance(w.tensors.get(f"{experts}.0.gate_proj.weight"), Fp8Weight):  # kept FP8: a layer per expert
            count = range(self.config.extra["num_experts"])
            return LinearExperts([w.linear([f"{experts}.{e}.gate_proj.weight", f"{experts}.{e}.up_proj.weight"])
                                  for e in count], [w.linear([f"{experts}.{e}.down_proj.weight"]) for e in count])
        else:
            gate_up = torch.cat([self._stacked(experts, "gate_proj"), self._stacked(experts, "up_proj")], dim=1)
            down = self._stacked(experts, "down_proj")
        return StackedExperts(gate_up.to(device, act_dtype), down.to(device, act_dtype))

    def _moe(self, prefix: str) -> SparseMoE:
        w, device, act_dtype, extra = self.w, self.device, self.act_dtype, self.config.extra
        return SparseMoE(
            router=w.dense(f"{prefix}.gate.weight").to(device, act_dtype), experts=self._experts(f"{prefix}.experts"),
            top_k=extra["num_experts_per_tok"], renormalize=extra.get("norm_topk_prob", True),
            shared_expert=self._mlp(f"{prefix}.shared_expert"),
            shared_gate=w.dense(f"{prefix}.shared_expert_gate.weight").to(device, act_dtype))
