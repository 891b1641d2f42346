"""Checkpoint loading: safetensors directories and GGUF files, as one normalised :class:`Checkpoint`."""

from __future__ import annotations

from pocketllm.checkpoint.base import Checkpoint
from pocketllm.checkpoint.resolve import DEFAULT_MODEL_ALIAS, MODEL_ALIASES, PackagedModel, load_checkpoint
from pocketllm.checkpoint.tensor import CheckpointTensor, RowPermutation

__all__ = ["DEFAULT_MODEL_ALIAS", "MODEL_ALIASES", "Checkpoint", "CheckpointTensor", "PackagedModel",
           "RowPermutation", "load_checkpoint"]
