"""GGUF files (llama.cpp): metadata, and tensors dequantized into Hugging Face names and layout."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import gguf
import numpy as np

from pocketllm.checkpoint import int4, int8
from pocketllm.checkpoint.base import Checkpoint
from pocketllm.checkpoint.configs import config_from_gguf
from pocketllm.checkpoint.int4 import Int4Groups
from pocketllm.checkpoint.int8 import Int8Groups
from pocketllm.errors import CheckpointError

T = TypeVar("T", Int4Groups, Int8Groups)

# GGUF tensor base names (without .weight/.bias) -> Hugging Face module names.
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Supported architectures -> whether llama.cpp's converter permuted the q/k rows into its rope layout.
_PERMUTES_QK = {"llama": True, "qwen2": False, "qwen3": False}
# llama.cpp precomputes Llama 3 rope frequencies as a tensor; Hugging Face models compute them instead.
_SKIPPED = frozenset({"rope_freqs.weight"})
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_UNQUANTIZED = frozenset({"ALL_F32", "F32", "F16", "BF16"})


class GGUFCheckpoint(Checkpoint):
    format = "gguf"

    def __init__(self, path: Path) -> None:
        self._reader = _open(path)
        try:
            meta = {
                name: field.contents() for name, field in self._reader.fields.items() if not name.startswith("GGUF.")
            }
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt GGUF metadata: {e}") from None
        self._metadata = meta
        config = config_from_gguf(meta, source=str(path), tensor_names={t.name for t in self._reader.tensors})
        if config.architecture not in _PERMUTES_QK:
            raise CheckpointError(
                f"{path}: GGUF architecture {config.architecture!r} is not supported "
                f"(supported: {', '.join(sorted(_PERMUTES_QK))})"
            )
        for tensor in self._reader.tensors:
            if tensor.name not in _SKIPPED:
                hf_name(tensor.name, path)  # fail at load time, not halfway through the weights
        super().__init__(path, config, _quantization(meta.get("general.file_type"), self._reader))

    @property
    def gguf_metadata(self) -> Mapping[str, Any]:
        return self._metadata

    def weights(self, *, int4_groups: bool = False,
                int8_groups: bool = False) -> Iterator[tuple[str, np.ndarray | Int4Groups | Int8Groups]]:
        permute = _PERMUTES_QK[self.config.architecture]
        heads = {"q_proj": self.config.num_attention_heads, "k_proj": self.config.num_key_value_heads}
        for tensor in self._reader.tensors:
            if tensor.name in _SKIPPED:
                continue
            name = hf_name(tensor.name, self.path)
            # GGUF lists dimensions fastest-first; Hugging Face layout is the reverse.
            shape = [int(d) for d in reversed(tensor.shape)]
            weight: np.ndarray | Int4Groups | Int8Groups
            if int4_groups and tensor.tensor_type in int4.INT4_TYPES and len(shape) == 2:
                weight = _groups(int4.from_gguf_blocks, tensor, shape, self.path)
            elif int8_groups and tensor.tensor_type in int8.INT8_TYPES and len(shape) == 2:
                weight = _groups(int8.from_gguf_blocks, tensor, shape, self.path)
            else:
                weight = _dequantize(tensor, self.path).reshape(shape)
            module = name.split(".")[-2]
            if permute and module in heads:
                n_head = heads[module]
                weight = (_unpermute_rows(weight, n_head) if isinstance(weight, np.ndarray)
                          else weight.map_rows(lambda rows, n=n_head: _unpermute_rows(rows, n)))
            yield name, weight


def hf_name(name: str, path: Path) -> str:
    """The Hugging Face name of a GGUF tensor: ``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    base, _, suffix = name.rpartition(".")
    if base in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = _LAYER.fullmatch(name)
    if match and match[2] in _LAYER_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"
    raise CheckpointError(f"{path}: GGUF tensor {name!r} has no Hugging Face equivalent")


class _Reader(gguf.GGUFReader):
    """GGUFReader parsing through a plain-ndarray view of its memory map.

    The parser slices the map once per metadata value (~100k times for a vocabulary), and
    numpy.memmap's per-slice bookkeeping makes that 3-4x slower. The view shares the same
    mapping, so tensor data stays on disk until dequantized.
    """

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._plain = value.view(np.ndarray)


def _open(path: Path) -> gguf.GGUFReader:
    try:
        return _Reader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, OSError) as e:
        # GGUFReader reports truncation (a tensor or value cut short) and garbage as whatever numpy raised first.
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from None


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return tensor.data  # already float32/float16: a view of the file, no copy
    try:
        return gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as e:
        raise CheckpointError(f"{path}: tensor {tensor.name!r}: {e}") from None


def _groups(unpack: Callable[..., T], tensor: Any, shape: list[int], path: Path) -> T:
    try:
        return unpack(tensor.data, tensor.tensor_type, *shape)
    except ValueError as e:
        raise CheckpointError(f"{path}: tensor {tensor.name!r}: {e}") from None


def _unpermute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k rows (inverse of convert_hf_to_gguf.LlamaModel.permute)."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _quantization(file_type: object, reader: gguf.GGUFReader) -> str | None:
    """The file's quantization as llama.cpp names it ("Q4_1", "Q4_K_M"), or None for a float file."""
    try:
        name = gguf.LlamaFileType(int(file_type) & ~gguf.LlamaFileType.GUESSED).name  # type: ignore[arg-type]
    except (TypeError, ValueError):
        # No or unknown file type: name it after the most common type among the matrices.
        types = [t.tensor_type.name for t in reader.tensors if len(t.shape) > 1]
        name = max(set(types), key=types.count) if types else "ALL_F32"
    name = name.removeprefix("MOSTLY_")
    return None if name in _UNQUANTIZED else name
