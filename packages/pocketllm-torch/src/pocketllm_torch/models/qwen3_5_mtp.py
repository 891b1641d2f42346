"""Qwen3.5's multi-token-prediction head (MTP), the drafter of ``speculative_method="mtp"``.

One full-attention decoder layer of the model's own kind (its MLP dense or routed as the model's are), between
two inputs and the model's output. At position i it reads the target's final hidden state h_i (after the final
norm) and the embedding of token i + 1, each normed, concatenated in that order and projected back to the hidden
size (``fc``); its output, normed, goes through the target's lm_head and predicts token i + 2. To draft further it
runs again on its own output and the token it drafted. As vLLM's Qwen3_5MultiTokenPredictor; transformers has no
MTP class. The layer keeps keys and values of its own, one more attention layer in the KV cache.

Tensors (``Checkpoint.mtp_tensors``): Hugging Face ``mtp.fc``, ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.norm`` and ``mtp.layers.0.*``; GGUF, as llama.cpp's converter writes them, the
layer as ``blk.<n>.*`` (n: the model's layer count) with ``blk.<n>.nextn.eh_proj``, ``enorm``, ``hnorm`` and
``shared_head_norm``. Norms are zero-centred like the model's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pocketllm.errors import CheckpointError
from pocketllm_torch.cache_spec import AttentionSpec
from pocketllm_torch.models.qwen3_5 import GatedAttention, HybridLayer, LayerLoader, Qwen3_5Model
from pocketllm_torch.models.weights import Weights

if TYPE_CHECKING:
    from collections.abc import Iterable

    import numpy as np
    from torch import Tensor

    from pocketllm.model_config import ModelConfig
    from pocketllm_torch.context import StepContext
    from pocketllm_torch.groups import Groups
    from pocketllm_torch.linear import Linear
    from pocketllm_torch.models.llama import Embedding, RMSNorm

_HF = {"fc": "mtp.fc.weight", "embedding_norm": "mtp.pre_fc_norm_embedding.weight",
       "hidden_norm": "mtp.pre_fc_norm_hidden.weight", "norm": "mtp.norm.weight"}
_GGUF = {"fc": "blk.{n}.nextn.eh_proj.weight", "embedding_norm": "blk.{n}.nextn.enorm.weight",
         "hidden_norm": "blk.{n}.nextn.hnorm.weight", "norm": "blk.{n}.nextn.shared_head_norm.weight"}
_HF_LAYER = re.compile(r"mtp\.layers\.(\d+)\.")


@dataclass(slots=True)
class Qwen3_5MTP:
    embed_tokens: Embedding  # the target's
    embedding_norm: RMSNorm
    hidden_norm: RMSNorm
    fc: Linear  # [hidden, 2 * hidden]
    layer: HybridLayer
    norm: RMSNorm
    target: Qwen3_5Model  # its lm_head and RoPE tables

    def __call__(self, input_ids: Tensor, hidden: Tensor, ctx: StepContext) -> Tensor:
        """The head's outputs, normed, [T, hidden] for tokens ``input_ids`` [T] after hidden states ``hidden`` [T,
        hidden] (the target's, normed, or the head's own); writes its keys and values (``ctx.caches[0]``)."""
        dtype = self.target.dtype
        x = torch.cat([self.embedding_norm(self.embed_tokens(input_ids).to(dtype)), self.hidden_norm(hidden)], -1)
        x = self.fc(x).to(dtype)
        rope = self.target.cos[ctx.positions].unsqueeze(1), self.target.sin[ctx.positions].unsqueeze(1)
        layer = self.layer
        x, h = layer.post_attention_norm.add(x, layer.mixer(layer.input_norm(x), rope, ctx.caches[0], ctx))
        return self.norm(x + layer.mlp(h))

    @property
    def cache_spec(self) -> AttentionSpec:
        attention = self.layer.mixer
        assert isinstance(attention, GatedAttention)
        return AttentionSpec(attention.num_kv_heads, attention.head_dim)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self.target.lm_head(hidden).float()

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: Iterable[tuple[str, np.ndarray | Groups]],
                     target: Qwen3_5Model, device: torch.device, dtype: torch.dtype) -> Qwen3_5MTP:
        w = Weights(weights, device, dtype)
        if not w.tensors:
            raise CheckpointError("speculative_method 'mtp': the checkpoint has no multi-token-prediction layers "
                                  "(mtp.* tensors, or GGUF blk.<n>.nextn.*)")
        gguf = not w.has(_HF["fc"])
        if not gguf and {int(m[1]) for name in w.tensors if (m := _HF_LAYER.match(name))} - {0}:
            raise CheckpointError("speculative_method 'mtp' runs one multi-token-prediction layer (mtp.layers.0); "
                                  "the checkpoint has more")
        n = config.num_hidden_layers  # the GGUF index of the head's layer
        names = {part: name.format(n=n) for part, name in (_GGUF if gguf else _HF).items()}
        load = LayerLoader(w, config, device, dtype)
        load.gguf = gguf  # the head's own naming, whatever the model's
        head = cls(
            embed_tokens=target.embed_tokens,
            embedding_norm=load.norm(names["embedding_norm"]),
            hidden_norm=load.norm(names["hidden_norm"]),
            fc=w.linear([names["fc"]]),
            layer=load.layer(f"model.layers.{n}" if gguf else "mtp.layers.0", n, "full_attention"),
            norm=load.norm(names["norm"]),
            target=target,
        )
        w.finish()
        return head
