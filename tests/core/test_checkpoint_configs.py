"""Test checkpoints' config.json files are what transformers' config classes write, with no key added by hand,
so that the reader is tested on the files published checkpoints carry (issue 31: a Qwen3.5 MoE config has no
intermediate_size, and the tests passed only because theirs added one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pocketllm.checkpoint import load_checkpoint
from pocketllm.checkpoint.configs import config_from_hf
from pocketllm.testing.checkpoints import HF_CLASSES, write_checkpoint

# The fields each config class writes (XConfig().save_pretrained(), transformers 5.24), which published
# checkpoints of the architecture carry; a model's save_pretrained adds MODEL_WRITTEN.
_EVERY = {"attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "head_dim", "hidden_act",
          "hidden_size", "initializer_range", "max_position_embeddings", "model_type", "num_attention_heads",
          "num_hidden_layers", "num_key_value_heads", "pad_token_id", "rms_norm_eps", "rope_parameters",
          "tie_word_embeddings", "transformers_version", "use_cache", "vocab_size"}
_LINEAR = {"layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_num_key_heads",
           "linear_num_value_heads", "linear_value_head_dim"}
PUBLISHED_FIELDS = {
    "LlamaConfig": _EVERY | {"intermediate_size", "mlp_bias", "pretraining_tp"},
    "Qwen3Config": _EVERY | {"intermediate_size", "layer_types", "max_window_layers", "sliding_window",
                             "use_sliding_window"},
    "Qwen3_5TextConfig": _EVERY | _LINEAR | {"intermediate_size"},
    # Every layer is a mixture of experts: no intermediate_size.
    "Qwen3_5MoeTextConfig": _EVERY | _LINEAR | {"moe_intermediate_size", "num_experts", "num_experts_per_tok",
                                                "output_router_logits", "router_aux_loss_coef",
                                                "shared_expert_intermediate_size"},
}
MODEL_WRITTEN = {"architectures", "dtype"}
# Qwen/Qwen3.5-35B-A3B's text model as Qwen3_5MoeTextConfig's defaults describe it (40 layers, every 4th full
# attention, 256 experts), every published field present and no other.
QWEN3_5_MOE_DEFAULTS = {
    "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None, "head_dim": 256,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_value_head_dim": 128, "max_position_embeddings": 32768,
    "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512, "num_attention_heads": 16, "num_experts": 256,
    "num_experts_per_tok": 8, "num_hidden_layers": 40, "num_key_value_heads": 2, "output_router_logits": False,
    "pad_token_id": None, "rms_norm_eps": 1e-06,
    "rope_parameters": {"partial_rotary_factor": 0.25, "rope_theta": 10000.0, "rope_type": "default"},
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
    "transformers_version": "5.24.0", "use_cache": True, "vocab_size": 248320,
}


def test_the_published_moe_config_reads_without_an_intermediate_size() -> None:
    assert set(QWEN3_5_MOE_DEFAULTS) == PUBLISHED_FIELDS["Qwen3_5MoeTextConfig"]
    config = config_from_hf(QWEN3_5_MOE_DEFAULTS, source="config.json", has_lm_head=True)
    assert (config.architecture, config.intermediate_size, config.num_hidden_layers) == ("qwen3_5_moe_text", 0, 40)
    assert (config.extra["moe_intermediate_size"], config.extra["num_experts"], config.rope_theta) == (512, 256, 1e4)
    assert config.extra["partial_rotary_factor"] == 0.25


@pytest.mark.parametrize("kind", list(HF_CLASSES))
def test_kit_configs_carry_the_published_field_set(tmp_path: Path, kind: str) -> None:
    path = write_checkpoint(kind, tmp_path)
    written = json.loads((path / "config.json").read_text())
    assert set(written) == PUBLISHED_FIELDS[HF_CLASSES[kind][0]] | MODEL_WRITTEN
    load_checkpoint(str(path))


def test_the_published_field_sets_are_what_transformers_writes(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    for name, fields in PUBLISHED_FIELDS.items():
        getattr(transformers, name)().save_pretrained(tmp_path / name)
        written = set(json.loads((tmp_path / name / "config.json").read_text()))
        assert fields <= written, (name, fields - written)  # a newer transformers may write more
    assert "intermediate_size" not in json.loads((tmp_path / "Qwen3_5MoeTextConfig" / "config.json").read_text())


@pytest.mark.parametrize("kind", list(HF_CLASSES))
def test_kit_configs_are_what_the_config_class_writes_for_their_values(tmp_path: Path, kind: str) -> None:
    transformers = pytest.importorskip("transformers")
    kit = json.loads((write_checkpoint(kind, tmp_path / "kit") / "config.json").read_text())
    config_class, model_class = HF_CLASSES[kind]
    config = getattr(transformers, config_class)(
        **{k: v for k, v in kit.items() if k not in MODEL_WRITTEN | {"model_type", "transformers_version"}})
    config.architectures, config.dtype = [model_class], "float32"  # what the model's save_pretrained sets
    config.save_pretrained(tmp_path / "class")
    written = json.loads((tmp_path / "class" / "config.json").read_text())
    assert set(kit) <= set(written), set(kit) - set(written)
    assert {k: v for k, v in kit.items() if k != "transformers_version"} == {
        k: written[k] for k in kit if k != "transformers_version"}
