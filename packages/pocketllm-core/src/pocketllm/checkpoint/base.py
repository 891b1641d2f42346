"""What every checkpoint format offers the rest of PocketLLM."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pocketllm.checkpoint.int4 import Int4Groups
from pocketllm.checkpoint.int8 import Int8Groups
from pocketllm.model_config import ModelConfig


class Checkpoint(ABC):
    """A model on disk: its normalised config and a lazy stream of its weights.

    Weights come out one at a time, named and laid out as in the Hugging Face
    checkpoint of the architecture, as float32 or float16 arrays. An array may
    be a read-only view of the file: copy it before writing to it.
    """

    format: ClassVar[str]

    def __init__(self, path: Path, config: ModelConfig, quantization: str | None = None) -> None:
        self.path = path
        self.config = config
        self.quantization = quantization

    @abstractmethod
    def weights(self, *, int4_groups: bool = False,
                int8_groups: bool = False) -> Iterator[tuple[str, np.ndarray | Int4Groups | Int8Groups]]:
        """Yield ``(hf_name, array)`` pairs, reading each tensor only when it is reached.

        With ``int4_groups``, matrices the file stores as 4-bit groups (GGUF Q4_0/Q4_1) come as
        :class:`Int4Groups` instead of being dequantized; with ``int8_groups``, those it stores as 8-bit
        groups (Q8_0) come as :class:`Int8Groups`. Every other tensor is an array as usual.
        """

    def tokenizer_files(self) -> dict[str, Path]:
        """Tokenizer files shipped next to the weights, by file name (``tokenizer.json``, ...)."""
        return {}

    @property
    def gguf_metadata(self) -> Mapping[str, Any]:
        """The GGUF key/value metadata, decoded to Python values; empty for other formats."""
        return {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r}, architecture={self.config.architecture!r})"
