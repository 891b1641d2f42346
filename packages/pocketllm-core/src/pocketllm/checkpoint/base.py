"""What every checkpoint format offers the rest of PocketLLM."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import numpy as np

from pocketllm.checkpoint.tensor import CheckpointTensor
from pocketllm.model_config import ModelConfig


class RecommendedSetting(msgspec.Struct, frozen=True):
    """One sampling setting as a checkpoint recommends it, before anything checked it."""

    key: str  # as the file spells it: ``max_new_tokens`` in generation_config.json, ``general.sampling.temp``
    field: str  # the SamplingParams field it sets
    value: Any


class Checkpoint:
    """A model on disk: its normalised config and a description of each tensor, read only when asked.

    By construction every tensor's byte range lies inside its file, and every tensor the config describes has
    the shape the config implies. Tensors are named and laid out as in the Hugging Face checkpoint of the
    architecture where the format allows (see the GGUF reader for what keeps its own name).
    """

    format: ClassVar[str]

    def __init__(self, path: Path, config: ModelConfig, tensors: list[CheckpointTensor],
                 quantization: str | None = None, mtp_tensors: list[CheckpointTensor] | None = None) -> None:
        self.path = path
        self.config = config
        self.quantization = quantization
        self._tensors = tensors
        self._mtp_tensors = mtp_tensors or []

    def tensors(self) -> list[CheckpointTensor]:
        """Every tensor of the model, in file order; nothing is read until a tensor's data is."""
        return list(self._tensors)

    def mtp_tensors(self) -> list[CheckpointTensor]:
        """The multi-token-prediction layers' tensors (Qwen3.5's ``mtp.*``; in GGUF the ``blk.<n>.*`` past the
        model's layers), kept apart from ``tensors()``: only speculative decoding with ``mtp`` runs them, and
        their shapes are the backend's to check. Empty when the checkpoint has none."""
        return list(self._mtp_tensors)

    def weights(self) -> Iterator[tuple[str, np.ndarray]]:
        """``(name, dequantized array)`` pairs, reading each tensor only when it is reached."""
        for tensor in self._tensors:
            yield tensor.name, tensor.dequantize()

    def recommended_sampling(self) -> list[RecommendedSetting]:
        """Sampling settings the checkpoint recommends, each mapped to its SamplingParams field (``temperature``,
        ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``max_tokens``) but unchecked; empty when it
        recommends none. ``pocketllm.sampling_defaults`` keeps those SamplingParams accepts."""
        return []

    def pooling_type(self) -> str | None:
        """How the checkpoint says its embeddings are pooled (a :data:`pocketllm.pooling.POOLING_TYPES` name, or
        the name of another mode, which embeddings then refuse), or None when it does not say."""
        return None

    def config_key(self, field: str) -> str:
        """Where the ModelConfig field ``field`` came from in the files (``config.json 'hidden_size'``,
        ``llama.embedding_length``), for error messages."""
        return field

    def tokenizer_files(self) -> dict[str, Path]:
        """Tokenizer files shipped next to the weights, by file name (``tokenizer.json``, ...)."""
        return {}

    @property
    def gguf_metadata(self) -> Mapping[str, Any]:
        """The GGUF key/value metadata, decoded to Python values; empty for other formats."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, architecture={self.config.architecture!r})"
