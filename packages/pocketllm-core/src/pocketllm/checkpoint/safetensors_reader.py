"""Hugging Face checkpoints: ``config.json`` plus one or more ``*.safetensors`` shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from pocketllm.checkpoint.base import Checkpoint
from pocketllm.checkpoint.configs import config_from_hf
from pocketllm.checkpoint.jsonfile import read_json_object
from pocketllm.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")
# BF16 has no numpy dtype: it is read raw and widened to float32. F64 is narrowed to float32.
_SUPPORTED_DTYPES = frozenset({"F32", "F16", "BF16", "F64"})


class SafetensorsCheckpoint(Checkpoint):
    format = "safetensors"

    def __init__(self, directory: Path) -> None:
        raw = read_json_object(directory / "config.json")
        generation = directory / "generation_config.json"
        generation_eos = read_json_object(generation).get("eos_token_id") if generation.is_file() else None
        self._shards = _shard_names(directory)
        names: set[str] = set()
        for shard, expected in self._shards.items():
            names.update(_check_shard(shard, expected))
        config = config_from_hf(
            raw,
            source=str(directory / "config.json"),
            has_lm_head="lm_head.weight" in names,
            generation_eos=generation_eos,
        )
        super().__init__(directory, config)

    def weights(self, *, int4_groups: bool = False, int8_groups: bool = False) -> Iterator[tuple[str, np.ndarray]]:
        del int4_groups, int8_groups  # safetensors holds no group formats: every tensor is an array
        for shard in self._shards:
            with _open(shard) as f:
                header: tuple[dict[str, Any], int] | None = None
                for name in f.offset_keys():
                    if name == "lm_head.weight" and self.config.tie_word_embeddings:
                        continue  # tied: the backend reuses the embedding, as transformers does
                    dtype = f.get_slice(name).get_dtype()
                    if dtype == "BF16":
                        header = header or _read_header(shard)
                        yield name, _read_bf16(shard, header, name)
                    elif dtype == "F64":
                        yield name, f.get_tensor(name).astype(np.float32)
                    else:
                        yield name, f.get_tensor(name)

    def tokenizer_files(self) -> dict[str, Path]:
        return {name: self.path / name for name in TOKENIZER_FILES if (self.path / name).is_file()}


def _shard_names(directory: Path) -> dict[Path, set[str] | None]:
    """Shard paths mapped to the tensor names the index promises for them (None without an index)."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: missing or empty 'weight_map'")
        shards: dict[Path, set[str]] = {}
        for name, file in weight_map.items():
            shards.setdefault(directory / str(file), set()).add(name)
        for shard in shards:
            if not shard.is_file():
                raise CheckpointError(f"{shard}: shard listed in {INDEX_FILE} is missing")
        return {shard: names for shard, names in sorted(shards.items())}
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{directory}: no *.safetensors files")
    return dict.fromkeys(found)


def _check_shard(shard: Path, expected: set[str] | None) -> list[str]:
    """Parse and validate a shard's header (safetensors checks offsets against the file size)."""
    with _open(shard) as f:
        names = f.keys()
        for name in names:
            dtype = f.get_slice(name).get_dtype()
            if dtype not in _SUPPORTED_DTYPES:
                raise CheckpointError(f"{shard}: tensor {name!r} has unsupported dtype {dtype}")
    if expected is not None and not expected <= set(names):
        missing = sorted(expected - set(names))[:5]
        raise CheckpointError(f"{shard}: lacks tensors listed in {INDEX_FILE}: {missing}")
    return names


def _open(shard: Path) -> Any:
    try:
        return safe_open(str(shard), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{shard}: not a valid safetensors file: {e}") from None


def _read_header(shard: Path) -> tuple[dict[str, Any], int]:
    """The JSON header and where the data section starts (safe_open has validated the layout already)."""
    with shard.open("rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)), 8 + size


def _read_bf16(shard: Path, header: tuple[dict[str, Any], int], name: str) -> np.ndarray:
    entries, data_start = header
    begin, end = entries[name]["data_offsets"]
    raw = np.memmap(shard, dtype=np.uint16, mode="r", offset=data_start + begin, shape=((end - begin) // 2,))
    # bfloat16 is the top half of a float32: widening is a 16-bit shift.
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(entries[name]["shape"])
