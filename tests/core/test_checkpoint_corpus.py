"""A corpus of truncated, corrupt and hostile checkpoint files: every one gives CheckpointError naming the file.

The files are made from the conformance kit's valid tiny checkpoints by cutting them or by overwriting one
header field at the byte position where the valid file keeps it.
"""

from __future__ import annotations

import contextlib
import json
import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from pocketllm.checkpoint import load_checkpoint
from pocketllm.errors import CheckpointError
from pocketllm.testing.checkpoints import make_tiny_gguf, make_tiny_llama


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return make_tiny_gguf(tmp_path_factory.mktemp("kit") / "tiny.gguf").read_bytes()


@pytest.fixture(scope="module")
def gguf_layout(tmp_path_factory: pytest.TempPathFactory, gguf_bytes: bytes) -> dict[str, int]:
    """Byte positions of the header fields the corpus overwrites, found by parsing the valid file."""
    path = tmp_path_factory.mktemp("layout") / "tiny.gguf"
    path.write_bytes(gguf_bytes)
    reader = gguf.GGUFReader(path)
    base = reader.data.ctypes.data

    def at(part: np.ndarray) -> int:
        return part.ctypes.data - base

    name_len, _, n_dims, dims, raw_dtype, offset = reader.tensors[0].field.parts
    tokens = reader.fields["tokenizer.ggml.tokens"]
    return {
        "tensor_count": 8, "kv_count": 16,
        "first_tensor_name_len": at(name_len), "first_tensor_n_dims": at(n_dims), "first_tensor_dim0": at(dims),
        "first_tensor_type": at(raw_dtype), "first_tensor_offset": at(offset),
        "last_tensor_offset": at(reader.tensors[-1].field.parts[-1]),
        "first_token_len": at(tokens.parts[tokens.data[0] - 1]),  # the length part before the first token's bytes
        "tokens_value_type": at(tokens.parts[2]),
    }


def _load(path: Path) -> None:
    checkpoint = load_checkpoint(str(path))
    for tensor in checkpoint.tensors():
        tensor.dequantize()


def _expect_checkpoint_error(path: Path, *, tensor: str | None = None) -> None:
    started = time.monotonic()
    with pytest.raises(CheckpointError) as err:
        _load(path)
    assert path.name in str(err.value)
    if tensor is not None:
        assert tensor in str(err.value)
    assert time.monotonic() - started < 10, "a hostile header must be refused quickly"


@pytest.mark.parametrize("fraction", [0.0005, 0.002, 0.01, 0.05, 0.2, 0.5, 0.9, 0.999])
def test_truncated_gguf(tmp_path: Path, gguf_bytes: bytes, fraction: float) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(gguf_bytes[:max(4, int(len(gguf_bytes) * fraction))])
    _expect_checkpoint_error(path)


@pytest.mark.parametrize(("field", "fmt", "value", "names_tensor"), [
    ("tensor_count", "<Q", 2**40, False),
    ("tensor_count", "<Q", 2**64 - 1, False),
    ("kv_count", "<Q", 2**62, False),
    ("kv_count", "<Q", 0, False),  # no metadata: no architecture
    ("first_tensor_name_len", "<Q", 2**63, False),
    ("first_tensor_n_dims", "<I", 9, False),
    ("first_tensor_dim0", "<Q", 2**40, True),
    ("first_tensor_dim0", "<Q", 0, True),
    ("first_tensor_dim0", "<Q", 2**64 - 1, True),
    ("first_tensor_type", "<I", 250, False),  # no such GGML type
    ("first_tensor_type", "<I", int(gguf.GGMLQuantizationType.Q4_K), True),  # row length not a multiple of 256
    ("first_tensor_offset", "<Q", 2**60, True),
    ("last_tensor_offset", "<Q", 2**20, True),
    ("first_token_len", "<Q", 2**62, False),
    ("tokens_value_type", "<I", 99, False),
])
def test_hostile_gguf_header(tmp_path: Path, gguf_bytes: bytes, gguf_layout: dict[str, int], field: str, fmt: str,
                             value: int, names_tensor: bool) -> None:
    data = bytearray(gguf_bytes)
    struct.pack_into(fmt, data, gguf_layout[field], value)
    path = tmp_path / "hostile.gguf"
    path.write_bytes(bytes(data))
    _expect_checkpoint_error(path, tensor="token_embd" if names_tensor and field.startswith("first") else None)


def _write_gguf(path: Path, *, embedding_length: int, vocab: int, rows: int) -> None:
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(embedding_length)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_tensor("token_embd.weight", np.ones((rows, 576), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_embedding_with_fewer_rows_than_the_vocabulary(tmp_path: Path) -> None:
    path = tmp_path / "short-embedding.gguf"
    _write_gguf(path, embedding_length=576, vocab=4096 + 64, rows=4096)
    with pytest.raises(CheckpointError, match=r"'token_embd\.weight' has shape \[4096, 576\].*\[4160, 576\]") as err:
        load_checkpoint(str(path))
    assert "tokenizer.ggml.tokens" in str(err.value) and path.name in str(err.value)


def test_gguf_hidden_size_one_off(tmp_path: Path) -> None:
    path = tmp_path / "wide.gguf"
    _write_gguf(path, embedding_length=577, vocab=64, rows=64)
    with pytest.raises(CheckpointError, match=r"\[64, 576\].*\[64, 577\].*llama\.embedding_length"):
        load_checkpoint(str(path))


# -- safetensors ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("kit-llama"))


def _copy(llama_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    target.mkdir()
    for item in llama_dir.iterdir():
        (target / item.name).write_bytes(item.read_bytes())
    return target


def _header(shard: Path) -> tuple[dict, bytes]:
    raw = shard.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def _rewrite(shard: Path, header: dict, data: bytes) -> None:
    encoded = json.dumps(header).encode()
    shard.write_bytes(len(encoded).to_bytes(8, "little") + encoded + data)


@pytest.mark.parametrize("damage", [
    "header_length_huge", "header_length_past_end", "header_not_an_object", "offsets_past_end",
    "offsets_disagree_with_shape", "negative_shape", "unknown_dtype", "integer_dtype", "cut_in_header",
    "cut_in_data",
])
def test_hostile_safetensors(tmp_path: Path, llama_dir: Path, damage: str) -> None:
    model = _copy(llama_dir, tmp_path)
    shard = model / "model.safetensors"
    header, data = _header(shard)
    name = "model.layers.0.self_attn.q_proj.weight"
    entry = header[name]
    if damage == "header_length_huge":
        shard.write_bytes((2**62).to_bytes(8, "little") + shard.read_bytes()[8:])
    elif damage == "header_length_past_end":
        shard.write_bytes((len(shard.read_bytes())).to_bytes(8, "little") + shard.read_bytes()[8:])
    elif damage == "header_not_an_object":
        _rewrite(shard, [1, 2, 3], data)  # type: ignore[arg-type]
    elif damage == "offsets_past_end":
        entry["data_offsets"] = [len(data) + 10, len(data) + 10 + 4 * 64 * 64]
        _rewrite(shard, header, data)
    elif damage == "offsets_disagree_with_shape":
        entry["shape"] = [64, 65]
        _rewrite(shard, header, data)
    elif damage == "negative_shape":
        entry["shape"] = [-64, -64]
        _rewrite(shard, header, data)
    elif damage == "unknown_dtype":
        entry["dtype"] = "F128"
        _rewrite(shard, header, data)
    elif damage == "integer_dtype":
        entry["dtype"], entry["shape"] = "I32", entry["shape"]
        _rewrite(shard, header, data)
    elif damage == "cut_in_header":
        shard.write_bytes(shard.read_bytes()[:100])
    else:
        shard.write_bytes(shard.read_bytes()[:-1000])
    _expect_checkpoint_error(shard)


@pytest.mark.parametrize(("key", "value", "tensor"), [
    ("hidden_size", 65, "lm_head.weight"),
    ("vocab_size", 4096, "lm_head.weight"),
    ("intermediate_size", 127, "model.layers.0.mlp.down_proj.weight"),
    ("num_key_value_heads", 4, "model.layers.0.self_attn.k_proj.weight"),
    ("num_hidden_layers", 1, "model.layers.1."),
])
def test_config_json_disagreeing_with_the_tensors(tmp_path: Path, llama_dir: Path, key: str, value: int,
                                                   tensor: str) -> None:
    model = _copy(llama_dir, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(str(model))
    assert tensor in str(err.value) and key in str(err.value), err.value


def test_random_header_mutations_only_ever_give_checkpoint_error(tmp_path: Path, gguf_bytes: bytes,
                                                                 gguf_layout: dict[str, int]) -> None:
    """300 files with random bytes, or random 64-bit values, written over the header: each one loads, or fails
    with CheckpointError, quickly."""
    rng = np.random.default_rng(11)
    header_end = gguf_layout["last_tensor_offset"] + 8
    path = tmp_path / "mutant.gguf"
    for i in range(300):
        data = bytearray(gguf_bytes)
        position = int(rng.integers(4, header_end - 8))
        if i % 2:
            struct.pack_into("<Q", data, position, int(rng.integers(0, 2**63)) * int(rng.choice([1, 2])) - 1)
        else:
            data[position] = int(rng.integers(0, 256))
        path.write_bytes(bytes(data))
        started = time.monotonic()
        with contextlib.suppress(CheckpointError):
            _load(path)
        assert time.monotonic() - started < 2, f"mutation {i} at {position} took too long"
