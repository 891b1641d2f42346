"""Hugging Face checkpoints: ``config.json`` plus one or more ``*.safetensors`` shards."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open

from pocketllm.checkpoint import fp8
from pocketllm.checkpoint.base import Checkpoint, RecommendedSetting
from pocketllm.checkpoint.configs import (
    GENERATION_CONFIG_KEYS,
    TEXT_WRAPPERS,
    config_from_hf,
    hf_key_of,
    recommended_settings,
)
from pocketllm.checkpoint.jsonfile import read_json_object
from pocketllm.checkpoint.shapes import check_mtp_shapes, check_shapes
from pocketllm.checkpoint.tensor import CheckpointTensor
from pocketllm.errors import CheckpointError

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# A multimodal wrapper's text weights, renamed to the text model's own names; its other towers are not loaded.
TEXT_MODEL_PREFIX = "model.language_model."
# Qwen3.5's multi-token-prediction layers, in both the text-only and the multimodal form (Checkpoint.mtp_tensors).
MTP_PREFIX = "mtp."
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json")
# Storage types of model weights: CheckpointTensor.dequantize widens BF16 and narrows F64 to float32.
# sentence-transformers' pooling flags, by the name of the mode (PoolingParams.pooling_type for those served).
_POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                  "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                  "pooling_mode_weightedmean_tokens": "weightedmean"}
_ITEM_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, fp8.FP8: 1}


class SafetensorsCheckpoint(Checkpoint):
    format = "safetensors"

    def __init__(self, directory: Path) -> None:
        raw = read_json_object(directory / "config.json")
        generation = directory / "generation_config.json"
        self._generation = read_json_object(generation) if generation.is_file() else {}
        generation_eos = self._generation.get("eos_token_id")
        tensors: list[CheckpointTensor] = []
        for shard, expected in _shard_names(directory).items():
            tensors += _shard_tensors(shard, expected)
        mtp = [t for t in tensors if t.name.startswith(MTP_PREFIX)]
        tensors = [t for t in tensors if not t.name.startswith(MTP_PREFIX)]
        if raw.get("model_type") in TEXT_WRAPPERS:
            tensors = _text_model_tensors(tensors, directory)
        quantization = raw.get("quantization_config")
        if quantization is not None or any(t.storage_type == fp8.FP8 for t in tensors + mtp):
            # After the wrapper's other towers are dropped: their layouts are not the text model's to refuse.
            tensors, mtp = (fp8.attach_scales(part, quantization, str(directory / "config.json"))
                            for part in (tensors, mtp))
        names = {t.name for t in tensors}
        if len(names) < len(tensors):
            raise CheckpointError(f"{directory}: a tensor name appears in more than one shard")
        config = config_from_hf(
            raw,
            source=str(directory / "config.json"),
            has_lm_head="lm_head.weight" in names,
            generation_eos=generation_eos,
        )
        if config.tie_word_embeddings:  # tied: the backend reuses the embedding, as transformers does
            tensors = [t for t in tensors if t.name != "lm_head.weight"]
        check_shapes(tensors, config, hf_key_of)
        check_mtp_shapes(mtp, config, hf_key_of)
        fp8_weights = any(t.storage_type == fp8.FP8 for t in tensors)
        super().__init__(directory, config, tensors, quantization="FP8" if fp8_weights else None, mtp_tensors=mtp)

    def recommended_sampling(self) -> list[RecommendedSetting]:
        # As vLLM reads generation_config.json: these keys only, max_new_tokens as the default max_tokens.
        return recommended_settings(self._generation, GENERATION_CONFIG_KEYS)

    def pooling_type(self) -> str | None:
        # sentence-transformers' layout: modules.json names the pooling module's folder, whose config flags one mode.
        modules = self.path / "modules.json"
        if not modules.is_file():
            return None
        try:
            entries = json.loads(modules.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{modules}: cannot read: {e}") from None
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and str(entry.get("type", "")).endswith("Pooling"):
                folder = self.path / str(entry.get("path", ""))
                flags = read_json_object(folder / "config.json")
                for key, name in _POOLING_MODES.items():
                    if flags.get(key) is True:
                        return name
        return None

    def config_key(self, field: str) -> str:
        return hf_key_of(field)

    def tokenizer_files(self) -> dict[str, Path]:
        return {name: self.path / name for name in TOKENIZER_FILES if (self.path / name).is_file()}


def _text_model_tensors(tensors: list[CheckpointTensor], directory: Path) -> list[CheckpointTensor]:
    """The language model's tensors of a multimodal wrapper under the text model's names (``model.*``,
    ``lm_head``); the vision tower is skipped, as transformers' text-only class skips it."""
    kept, skipped = [], []
    for t in tensors:
        if t.name.startswith(TEXT_MODEL_PREFIX):
            kept.append(dataclasses.replace(t, name="model." + t.name.removeprefix(TEXT_MODEL_PREFIX)))
        elif t.name == "lm_head.weight":
            kept.append(t)
        else:
            skipped.append(t.name)
    if skipped:
        towers = sorted({name.split(".")[1] if name.startswith("model.") else name.split(".")[0] for name in skipped})
        log.info("%s: serving the text model; skipping %d tensors of %s", directory, len(skipped), ", ".join(towers))
    return kept


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


def _shard_tensors(shard: Path, expected: set[str] | None) -> list[CheckpointTensor]:
    """Describe a shard's tensors once safetensors itself has validated the file's layout."""
    with _open(shard) as f:
        names = list(f.keys())
    if expected is not None and not expected <= set(names):
        missing = sorted(expected - set(names))[:5]
        raise CheckpointError(f"{shard}: lacks tensors listed in {INDEX_FILE}: {missing}")
    entries, data_start = _read_header(shard)
    data = np.memmap(shard, dtype=np.uint8, mode="r").view(np.ndarray)
    tensors = []
    for name in names:
        entry = entries[name]
        # safetensors calls the storage type "dtype"
        storage_type, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if storage_type not in _ITEM_SIZES:
            raise CheckpointError(f"{shard}: tensor {name!r} has unsupported storage type {storage_type}")
        if end - begin != math.prod(shape) * _ITEM_SIZES[storage_type] or data_start + end > data.size:
            raise CheckpointError(f"{shard}: tensor {name!r}: bytes [{begin}, {end}) do not hold {storage_type} "
                                  f"{list(shape)}")
        start = data_start + begin
        tensors.append(CheckpointTensor(name=name, file_name=name, shape=shape, storage_type=storage_type, path=shard,
                                        offset=start, nbytes=end - begin, _buffer=data[start:data_start + end]))
    return tensors


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
