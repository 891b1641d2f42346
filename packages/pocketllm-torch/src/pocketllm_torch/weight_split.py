"""Which part of each weight a tensor-parallel rank holds (see tensor_parallel.py for the scheme).

Per layer type, with Hugging Face layouts ([out features, in features]; stacked experts [E, out, in]):

- attention: q (Qwen3.5: each head's query and output gate), k and v by rows of this rank's heads, which go to
  ranks whole with their query groups (KV heads split as evenly as possible); o_proj by the same columns;
- MLP, each expert and the shared expert: gate/up by rows, down by columns of this rank's intermediate features;
- Gated DeltaNet: this rank's key heads and the value heads they serve (Hugging Face groups them, llama.cpp's
  GGUF tiles them: value head j * Hk + k reads key head k), in q/k/v (the convolution's channels too), z, b, a,
  A_log and dt_bias; out_proj by the same value columns;
- the embedding and LM head by rows of the vocabulary, padded so that every rank's slice has the same size;
- norms and routers whole. A row-parallel bias is kept by rank 0 alone, so the all-reduce adds it once.

4- and 8-bit grouped matrices are cut by rows, or by columns at their 32-column group boundaries (a cut inside a
group is refused); they stay grouped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgspec
import numpy as np

from pocketllm.errors import UnsupportedOptionError
from pocketllm.model_config import ModelConfig
from pocketllm_torch.groups import GROUP_SIZE, Groups
from pocketllm_torch.name import NAME

Weight = np.ndarray | Groups
TP_ARCHITECTURES = ("llama", "qwen3", "qwen3_5_text", "qwen3_5_moe_text")
_HYBRID = ("qwen3_5_text", "qwen3_5_moe_text")
_LAYER = re.compile(r"(?:model\.layers|blk)\.\d+\.(.+)")
# Name after the layer prefix -> (part of the split, axis it cuts). GGUF names are those llama.cpp's reader left
# unmapped (Qwen3.5's: their values changed, see models/qwen3_5.py).
_RULES: dict[str, tuple[str, int]] = {
    "self_attn.q_proj.weight": ("q", 0), "self_attn.q_proj.bias": ("q", 0),
    "self_attn.k_proj.weight": ("kv", 0), "self_attn.k_proj.bias": ("kv", 0),
    "self_attn.v_proj.weight": ("kv", 0), "self_attn.v_proj.bias": ("kv", 0),
    "self_attn.o_proj.weight": ("o", 1), "self_attn.o_proj.bias": ("first", 0),
    "mlp.gate_proj.weight": ("ff", 0), "mlp.up_proj.weight": ("ff", 0),
    "mlp.gate_proj.bias": ("ff", 0), "mlp.up_proj.bias": ("ff", 0),
    "mlp.down_proj.weight": ("ff", 1), "mlp.down_proj.bias": ("first", 0),
    "mlp.experts.*.gate_proj.weight": ("expert", 0), "mlp.experts.*.up_proj.weight": ("expert", 0),
    "mlp.experts.*.down_proj.weight": ("expert", 1),
    "mlp.experts.gate_proj.weight": ("expert", 1), "mlp.experts.up_proj.weight": ("expert", 1),  # stacked
    "mlp.experts.down_proj.weight": ("expert", 2),
    "mlp.experts.gate_up_proj": ("expert_gate_up", 1), "mlp.experts.down_proj": ("expert", 2),  # fused
    "mlp.shared_expert.gate_proj.weight": ("shared", 0), "mlp.shared_expert.up_proj.weight": ("shared", 0),
    "mlp.shared_expert.down_proj.weight": ("shared", 1),
    "linear_attn.in_proj_qkv.weight": ("qkv", 0), "attn_qkv.weight": ("qkv", 0),
    "linear_attn.conv1d.weight": ("qkv", 0), "ssm_conv1d.weight": ("qkv", 0),
    "linear_attn.in_proj_z.weight": ("values", 0), "attn_gate.weight": ("values", 0),
    "linear_attn.out_proj.weight": ("values", 1), "ssm_out.weight": ("values", 1),
    "linear_attn.in_proj_b.weight": ("v_heads", 0), "ssm_beta.weight": ("v_heads", 0),
    "linear_attn.in_proj_a.weight": ("v_heads", 0), "ssm_alpha.weight": ("v_heads", 0),
    "linear_attn.A_log": ("v_heads", 0), "ssm_a": ("v_heads", 0),
    "linear_attn.dt_bias": ("v_heads", 0), "ssm_dt.bias": ("v_heads", 0),
}
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")
_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True, slots=True)
class Split:
    """This rank's share: index arrays of the rows (or columns) it holds, by part of the model."""

    parts: dict[str, np.ndarray]
    vocab: tuple[int, int]  # this rank's real vocabulary rows; its slice is padded to vocab_rows
    vocab_rows: int
    first: bool  # rank 0: keeps the row-parallel biases
    local: dict[str, int]  # the config's sizes for this rank

    @classmethod
    def of(cls, config: ModelConfig, rank: int, world_size: int, *, tiled_values: bool = False) -> Split:
        """``tiled_values``: the checkpoint orders Gated DeltaNet value heads as llama.cpp's GGUF does."""
        if config.architecture not in TP_ARCHITECTURES:
            raise UnsupportedOptionError("tensor_parallel_size", NAME, f"tensor parallelism runs "
                                         f"{', '.join(TP_ARCHITECTURES)}, not {config.architecture}")
        kv, heads, dim = config.num_key_value_heads, config.num_attention_heads, config.head_dim
        if kv < world_size:
            raise UnsupportedOptionError("tensor_parallel_size", NAME, f"{world_size} ranks, but the model has "
                                         f"only {kv} KV heads to split (replicating them is not implemented)")
        kv0, kv1 = _even(kv, world_size, rank)
        h0, h1 = kv0 * (heads // kv), kv1 * (heads // kv)
        q_width = 2 * dim if config.architecture in _HYBRID else dim  # Qwen3.5: each head's query and gate
        parts = {"q": _spans(range(h0, h1), q_width), "kv": _spans(range(kv0, kv1), dim),
                 "o": _spans(range(h0, h1), dim)}
        local = {"num_attention_heads": h1 - h0, "num_key_value_heads": kv1 - kv0}
        for part, key in (("ff", "intermediate_size"), ("expert", "moe_intermediate_size"),
                          ("shared", "shared_expert_intermediate_size")):
            size = getattr(config, key) if key == "intermediate_size" else config.extra.get(key)
            if isinstance(size, int) and size > 0:
                parts[part] = _aligned_share(size, world_size, rank)
                local[key] = len(parts[part])
        if "expert" in parts:
            parts["expert_gate_up"] = np.concatenate([parts["expert"], config.extra["moe_intermediate_size"]
                                                      + parts["expert"]])
        if config.architecture in _HYBRID:
            parts |= _gated_deltanet(config, rank, world_size, tiled_values, local)
        per_rank = -(-config.vocab_size // world_size)
        vocab = (min(config.vocab_size, rank * per_rank), min(config.vocab_size, (rank + 1) * per_rank))
        return cls(parts=parts, vocab=vocab, vocab_rows=per_rank, first=rank == 0, local=local)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        fields = {k: v for k, v in self.local.items() if k in ModelConfig.__struct_fields__}
        extra = {k: v for k, v in self.local.items() if k not in ModelConfig.__struct_fields__}
        return msgspec.structs.replace(config, **fields, extra=config.extra | extra)

    def shard(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        for name, w in weights:
            if name in _VOCAB:
                yield name, _pad_rows(_take(w, np.arange(*self.vocab), 0, name), self.vocab_rows)
                continue
            match = _LAYER.fullmatch(name)
            rule = _RULES.get(_EXPERT_INDEX.sub(".experts.*.", f".{match[1]}")[1:]) if match else None
            if rule is None:
                yield name, w  # norms and routers: every rank needs them whole
            elif rule[0] == "first":
                yield name, w if self.first else w * 0
            else:
                yield name, _take(w, self.parts[rule[0]], rule[1], name)


def _gated_deltanet(config: ModelConfig, rank: int, world_size: int, tiled: bool,
                    local: dict[str, int]) -> dict[str, np.ndarray]:
    hk, hv = config.extra["linear_num_key_heads"], config.extra["linear_num_value_heads"]
    dk, dv = config.extra["linear_key_head_dim"], config.extra["linear_value_head_dim"]
    if hk < world_size:
        raise UnsupportedOptionError("tensor_parallel_size", NAME, f"{world_size} ranks, but the model has only "
                                     f"{hk} linear-attention key heads to split")
    k0, k1 = _even(hk, world_size, rank)
    per_key = hv // hk
    values = (np.array([j * hk + k for j in range(per_key) for k in range(k0, k1)]) if tiled
              else np.arange(k0 * per_key, k1 * per_key))
    local |= {"linear_num_key_heads": k1 - k0, "linear_num_value_heads": len(values)}
    keys = _spans(range(k0, k1), dk)
    return {"qkv": np.concatenate([keys, hk * dk + keys, 2 * hk * dk + _spans(values, dv)]),
            "values": _spans(values, dv), "v_heads": values}


def _even(total: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of ``total`` split as evenly as possible."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def _aligned_share(size: int, parts: int, index: int) -> np.ndarray:
    """This rank's features of ``size``, in whole 32-feature groups where they divide so (grouped matrices)."""
    unit = GROUP_SIZE if size % GROUP_SIZE == 0 and size // GROUP_SIZE >= parts else 1
    start, end = _even(size // unit, parts, index)
    return np.arange(start * unit, end * unit)


def _spans(heads: Iterable[int], width: int) -> np.ndarray:
    return np.concatenate([np.arange(h * width, (h + 1) * width) for h in heads] or [np.arange(0)])


def _take(w: Weight, index: np.ndarray, axis: int, name: str) -> Weight:
    if isinstance(w, np.ndarray):
        return np.ascontiguousarray(np.take(w, index, axis=axis))
    if axis == 0:
        return type(w)(*(getattr(w, f)[index] for f in w.__dataclass_fields__))
    # Columns of a grouped matrix: only whole groups can be cut out.
    blocks = index.reshape(-1, GROUP_SIZE) if index.size % GROUP_SIZE == 0 else None
    if blocks is None or (blocks[:, 0] % GROUP_SIZE).any() or (np.diff(blocks, axis=1) != 1).any():
        raise UnsupportedOptionError("tensor_parallel_size", NAME, f"{name}: this rank's columns do not fall on "
                                     f"its {GROUP_SIZE}-column groups of 4- or 8-bit weights")
    codes, *groups = (getattr(w, f) for f in w.__dataclass_fields__)
    return type(w)(codes[:, index], *(g[:, blocks[:, 0] // GROUP_SIZE] for g in groups))


def _pad_rows(w: Weight, rows: int) -> Weight:
    missing = rows - w.shape[0]
    if missing == 0:
        return w
    if isinstance(w, np.ndarray):
        return np.concatenate([w, np.zeros((missing, *w.shape[1:]), w.dtype)])
    return type(w)(*(np.concatenate([a, np.zeros((missing, *a.shape[1:]), a.dtype)])
                     for a in (getattr(w, f) for f in w.__dataclass_fields__)))
