"""Qwen3 (dense): the Llama decoder with an RMSNorm over each head of q and k before RoPE."""

from __future__ import annotations

from typing import ClassVar

from pocketllm_torch.models.llama import LlamaModel


class Qwen3Model(LlamaModel):
    __slots__ = ()
    QK_NORM: ClassVar[bool] = True
