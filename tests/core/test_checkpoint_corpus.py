"""A corpus of truncated, corrupt and hostile checkpoint files: every one gives CheckpointError naming the file.

The files are made from the conformance kit's valid tiny checkpoints by cutting them or by overwriting one
header field at the byte position where the valid file keeps it.
"""

from __future__ import annotations

import contextlib
import json
import struct
import time
from collections.abc import Callable
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


# -- metadata a model relies on (issue 31): each mutant of the tiny GGUF is refused at load, naming the field ----


def _set_field(key: str, value: float) -> Callable[[gguf.GGUFReader], None]:
    def mutate(reader: gguf.GGUFReader) -> None:
        field = reader.fields[key]
        field.parts[field.data[0]][0] = value
    return mutate


def _corrupt_tensor_name(reader: gguf.GGUFReader) -> None:
    name = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight").field.parts[1]
    name[-3] = ord("X")  # blk.0.attn_k.weiXht


def _misalign_last_tensor(reader: gguf.GGUFReader) -> None:
    reader.tensors[-1].field.parts[-1][0] += 1


def _corrupt_first_merge(reader: gguf.GGUFReader) -> None:
    field = reader.fields["tokenizer.ggml.merges"]
    field.parts[field.data[0]][1] = ord("#")  # "e e" -> "e#e"


def _nan_weights(reader: gguf.GGUFReader) -> None:
    next(t for t in reader.tensors if t.name == "output_norm.weight").data[:] = np.nan


_MUTANTS = {
    "eos_outside_vocabulary": (_set_field("tokenizer.ggml.eos_token_id", 2**32 - 1), "tokenizer.ggml.eos_token_id"),
    "eos_one_past_the_vocabulary": (_set_field("tokenizer.ggml.eos_token_id", 323), "tokenizer.ggml.eos_token_id"),
    "no_kv_heads": (_set_field("llama.attention.head_count_kv", 0), "llama.attention.head_count_kv"),
    "kv_heads_not_dividing": (_set_field("llama.attention.head_count_kv", 3), "llama.attention.head_count_kv"),
    "no_heads": (_set_field("llama.attention.head_count", 0), "llama.attention.head_count"),
    "huge_block_count": (_set_field("llama.block_count", 2**31), "llama.block_count"),
    "block_count_past_the_tensors": (_set_field("llama.block_count", 3), "llama.block_count"),
    "no_context": (_set_field("llama.context_length", 0), "llama.context_length"),
    "nan_norm_epsilon": (_set_field("llama.attention.layer_norm_rms_epsilon", float("nan")),
                         "llama.attention.layer_norm_rms_epsilon"),
    "zero_rope_base": (_set_field("llama.rope.freq_base", 0.0), "llama.rope.freq_base"),
    "corrupted_tensor_name": (_corrupt_tensor_name, "blk.0.attn_k.weiXht"),
    "odd_tensor_offset": (_misalign_last_tensor, "general.alignment"),
    "corrupted_merges": (_corrupt_first_merge, "tokenizer.ggml.merges"),
    "nan_weights": (_nan_weights, "warm-up"),
}


@pytest.mark.parametrize("mutant", list(_MUTANTS))
def test_gguf_mutants_are_refused_at_load_naming_the_field(tmp_path: Path, gguf_bytes: bytes, mutant: str) -> None:
    """Each loaded before, or failed with a bare ZeroDivisionError, KeyError, ValueError or tokenizers Exception, or
    answered every request with an error (EOS 2**32 - 1) or NaN."""
    from pocketllm import LLM

    mutate, field = _MUTANTS[mutant]
    path = tmp_path / f"{mutant}.gguf"
    path.write_bytes(gguf_bytes)
    reader = gguf.GGUFReader(path, "r+")
    mutate(reader)
    reader.data.flush()
    del reader
    with pytest.raises(CheckpointError) as err:
        LLM(str(path), max_model_len=64).shutdown()
    assert path.name in str(err.value) and field in str(err.value), err.value


@pytest.mark.parametrize(("key", "value"), [
    ("eos_token_id", 10**6), ("eos_token_id", [0, -1]), ("bos_token_id", 323), ("num_key_value_heads", 0),
    ("num_key_value_heads", 3), ("rms_norm_eps", -1.0), ("max_position_embeddings", 0),
])
def test_config_json_values_out_of_range(tmp_path: Path, llama_dir: Path, key: str, value: object) -> None:
    model = _copy(llama_dir, tmp_path)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, key: value}))
    with pytest.raises(CheckpointError, match=rf"config\.json.*{key}") as err:
        load_checkpoint(str(model))
    assert str(model) in str(err.value)


def test_a_safetensors_tensor_under_a_corrupted_name_is_refused_at_load(tmp_path: Path, llama_dir: Path) -> None:
    from pocketllm import LLM

    model = _copy(llama_dir, tmp_path)
    shard = model / "model.safetensors"
    header, data = _header(shard)
    header["model.layers.1.mlp.up_projXweight"] = header.pop("model.layers.1.mlp.up_proj.weight")
    _rewrite(shard, header, data)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*up_projXweight") as err:
        LLM(str(model)).shutdown()
    assert str(model) in str(err.value)
