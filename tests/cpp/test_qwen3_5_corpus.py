"""The corrupt-file corpus for Qwen3.5 GGUFs (llama.cpp's `qwen35`/`qwen35moe` layout, as tests/torch/qwen3_5_kit.py
writes it): wrong head counts, inconsistent ``ssm.*`` sizes, missing or extra tensors and an absurd expert count.
Each is refused with CheckpointError naming the file and what is wrong, before an engine starts; with every ISA the
native kernels have, nothing crashes the interpreter on the way."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

pytest.importorskip("transformers")

from pocketllm import LLM
from pocketllm.checkpoint import load_checkpoint
from pocketllm.errors import CheckpointError
from pocketllm_cpp import kernels
from tests.torch.qwen3_5_kit import tiny_qwen3_5, to_gguf

U32, U64 = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.UINT64


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A valid dense and MoE Qwen3.5 GGUF."""
    out = {}
    for kind, moe in (("dense", False), ("moe", True)):
        folder = tmp_path_factory.mktemp(kind)
        hf, _ = tiny_qwen3_5(folder / "hf", moe=moe)
        out[kind] = to_gguf(hf, folder / f"{kind}.gguf")
    return out


def rewrite(source: Path, out: Path, *, fields: dict[str, tuple[Any, gguf.GGUFValueType]] | None = None,
            drop: tuple[str, ...] = (), add: dict[str, np.ndarray] | None = None) -> Path:
    """``source`` written again with some metadata values replaced (or added), tensors dropped or added."""
    fields = dict(fields or {})
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in fields:
            writer.add_key_value(key, *fields.pop(key))
        else:
            array = field.types[0] == gguf.GGUFValueType.ARRAY
            writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if array else None)
    for key, (value, value_type) in fields.items():
        writer.add_key_value(key, value, value_type)
    for tensor in reader.tensors:
        if tensor.name not in drop:
            shape = [int(d) for d in reversed(tensor.shape)]  # the reader lists GGML's order, innermost first
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_shape=shape, raw_dtype=tensor.tensor_type)
    for name, array in (add or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _field(key: str, value: int, value_type: gguf.GGUFValueType = U32) -> Callable[[Path, Path], Path]:
    return lambda source, out: rewrite(source, out, fields={key: (value, value_type)})


_MUTANTS: dict[str, tuple[str, Callable[[Path, Path], Path], str]] = {
    # name: (which file, how it is damaged, what the error names)
    "heads_not_matching_q": ("dense", _field("qwen35.attention.head_count", 3), "qwen35.attention.head_count"),
    "kv_heads_not_dividing": ("dense", _field("qwen35.attention.head_count_kv", 3), "head_count_kv"),
    "no_kv_heads": ("dense", _field("qwen35.attention.head_count_kv", 0), "head_count_kv"),
    "ssm_inner_size": ("dense", _field("qwen35.ssm.inner_size", 48), "qwen35.ssm.inner_size"),
    "ssm_state_size": ("dense", _field("qwen35.ssm.state_size", 8), "qwen35.ssm.state_size"),
    "ssm_group_count_not_dividing": ("dense", _field("qwen35.ssm.group_count", 3), "qwen35.ssm.group_count"),
    "ssm_no_groups": ("dense", _field("qwen35.ssm.group_count", 0), "qwen35.ssm.group_count"),
    "ssm_time_step_rank": ("dense", _field("qwen35.ssm.time_step_rank", 6), "qwen35.ssm"),
    "ssm_conv_kernel": ("dense", _field("qwen35.ssm.conv_kernel", 9), "qwen35.ssm.conv_kernel"),
    "ssm_huge_conv_kernel": ("dense", _field("qwen35.ssm.conv_kernel", 2**31), "qwen35.ssm.conv_kernel"),
    "missing_ssm_a": ("dense", lambda s, o: rewrite(s, o, drop=("blk.0.ssm_a",)), "blk.0.ssm_a"),
    "missing_conv": ("dense", lambda s, o: rewrite(s, o, drop=("blk.1.ssm_conv1d.weight",)), "ssm_conv1d"),
    "missing_attention_gate": ("dense", lambda s, o: rewrite(s, o, drop=("blk.3.attn_q.weight",)), "q_proj"),
    "extra_tensor": ("dense", lambda s, o: rewrite(s, o, add={"blk.0.ssm_bogus.weight": np.zeros((4, 4), np.float32)}),
                     "blk.0.ssm_bogus.weight"),
    "expert_count_2_40": ("moe", _field("qwen35moe.expert_count", 2**40, U64), "qwen35moe.expert_count"),
    "experts_used_past_count": ("moe", _field("qwen35moe.expert_used_count", 9), "qwen35moe.expert_used_count"),
    "no_experts_used": ("moe", _field("qwen35moe.expert_used_count", 0), "qwen35moe.expert_used_count"),
    "missing_expert_tensor": ("moe", lambda s, o: rewrite(s, o, drop=("blk.2.ffn_up_exps.weight",)), "experts.up_proj"),
}


@pytest.mark.parametrize("mutant", list(_MUTANTS))
def test_damaged_qwen3_5_gguf_is_a_checkpoint_error(files: dict[str, Path], tmp_path: Path, mutant: str) -> None:
    kind, damage, named = _MUTANTS[mutant]
    path = damage(files[kind], tmp_path / f"{mutant}.gguf")
    with pytest.raises(CheckpointError) as err:
        LLM(str(path), max_model_len=64).shutdown()
    assert path.name in str(err.value) and named in str(err.value), err.value


def test_the_rewriter_keeps_a_valid_file_valid(files: dict[str, Path], tmp_path: Path) -> None:
    """The corpus's damage is its own: rewritten unchanged, each file still loads, with the same tensors."""
    for kind, path in files.items():
        again = load_checkpoint(str(rewrite(path, tmp_path / f"{kind}.gguf")))
        original = load_checkpoint(str(path))
        assert again.config == original.config
        for a, b in zip(again.tensors(), original.tensors(), strict=True):
            assert a.name == b.name
            np.testing.assert_array_equal(a.dequantize(), b.dequantize())


@pytest.mark.parametrize("isa", kernels.available_isas().split())
def test_every_isa_survives_the_corpus(files: dict[str, Path], tmp_path: Path, isa: str) -> None:
    """Under each ISA the kernels run, loading every damaged file ends in CheckpointError (never a crash)."""
    kernels.set_isa(isa)
    try:
        for mutant, (kind, damage, _) in _MUTANTS.items():
            with pytest.raises(CheckpointError):
                LLM(str(damage(files[kind], tmp_path / f"{isa}-{mutant}.gguf")), max_model_len=64).shutdown()
    finally:
        kernels.set_isa("auto")
