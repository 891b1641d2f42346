"""The Qwen3.5 workloads' own logic (pocketbench.qwen3_5, qwen3_5_models, prefix_sharing); figures are never
asserted. Making and serving the real files needs llama.cpp and minutes: ``python -m pocketbench.qwen3_5``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from pocketbench.config import EngineSpec
from pocketbench.qwen3_5 import bytes_per_token, refusal
from pocketbench.qwen3_5_models import DENSE_0_8B, MODELS, MOE_35B_A3B_SCALED, ModelSpec

TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "head_dim": 32,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "num_experts": 4, "num_experts_per_tok": 2}


def test_the_published_configurations_are_kept() -> None:
    assert (DENSE_0_8B["hidden_size"], DENSE_0_8B["num_hidden_layers"], DENSE_0_8B["vocab_size"]) == (1024, 24, 248320)
    assert MOE_35B_A3B_SCALED["num_experts_per_tok"] == 8 and MOE_35B_A3B_SCALED["moe_intermediate_size"] == 512
    spec = MODELS["dense"].with_layers(8)
    assert (spec.name, spec.config["num_hidden_layers"]) == ("qwen3_5-0.8b-8l", 8)
    assert spec.layer_types().count("full_attention") == 2


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_written_checkpoints_load_as_qwen3_5(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moe: bool) -> None:
    pytest.importorskip("transformers")
    from pocketbench import qwen3_5_models
    from pocketllm.checkpoint import load_checkpoint

    monkeypatch.setattr(qwen3_5_models, "SHARD_BYTES", 1 << 18)  # several shards, and their index
    base = MOE_35B_A3B_SCALED if moe else DENSE_0_8B
    config = base | {k: v for k, v in TINY.items() if k in base} | {"num_hidden_layers": 4}
    path = qwen3_5_models.write_checkpoint(ModelSpec("tiny", moe, config), tmp_path / "hf")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    checkpoint = load_checkpoint(str(path))
    assert checkpoint.config.architecture == ("qwen3_5_moe_text" if moe else "qwen3_5_text")
    assert checkpoint.config.hidden_size == 64 and checkpoint.config.num_hidden_layers == 4
    assert ("lm_head.weight" in {t.name for t in checkpoint.tensors()}) == moe  # the dense one ties its embeddings


def _tensor(name: str, nbytes: int, shape: tuple[int, ...]) -> SimpleNamespace:
    return SimpleNamespace(name=name, nbytes=nbytes, shape=shape)


def test_bytes_per_token_reads_one_embedding_row_and_the_routed_experts() -> None:
    tensors = [_tensor("model.embed_tokens.weight", 1000, (100, 8)), _tensor("lm_head.weight", 1000, (100, 8)),
               _tensor("model.layers.0.mlp.experts.gate_proj.weight", 800, (8, 4, 8)),
               _tensor("model.layers.0.input_layernorm.weight", 32, (8,))]
    config = SimpleNamespace(tie_word_embeddings=False, extra={"num_experts": 8, "num_experts_per_tok": 2})
    checkpoint = SimpleNamespace(config=config, tensors=lambda: tensors)
    assert bytes_per_token(checkpoint) == 10 + 1000 + 200 + 32  # type: ignore[arg-type]
    tied = SimpleNamespace(config=SimpleNamespace(tie_word_embeddings=True, extra={}), tensors=lambda: tensors[:1])
    assert bytes_per_token(tied) == 1000  # type: ignore[arg-type]


def test_a_backend_that_cannot_serve_a_file_says_why(tmp_path: Path) -> None:
    pytest.importorskip("pocketllm_echo")
    from pocketllm.checkpoint import load_checkpoint
    from pocketllm.testing import make_tiny_llama

    checkpoint = load_checkpoint(str(make_tiny_llama(tmp_path / "model")))
    assert refusal("echo", checkpoint) is None
    assert "enable_prefix_caching" in (refusal("echo", checkpoint, prefix_caching=True) or "")
    assert refusal("no-such-backend", checkpoint) == "not installed"


def test_the_shared_prefix_workload_on_the_echo_backend(tmp_path: Path) -> None:
    """Workers, a fresh question per request and run, the token-count check, figures and peak RSS, end to end."""
    pytest.importorskip("pocketllm_echo")
    pytest.importorskip("tqdm")
    from pocketbench import prefix_sharing
    from pocketbench.results import BenchResults
    from pocketllm.testing import make_tiny_llama

    model = str(make_tiny_llama(tmp_path / "model", max_positions=2048))
    sizes = prefix_sharing.PrefixSizes(requests=3, prefix_tokens=40, question_tokens=5, new_tokens=4)
    spec = EngineSpec(kind="pocketllm", backend="echo", model=model, model_path=model, threads=1, max_seqs=3,
                      max_len=sizes.max_len)
    assert prefix_sharing.specs_for([spec], sizes)[0].prefix_caching
    results = BenchResults(meta={}, engines={}, ours=["pocketllm-echo"], peers=[])
    prefix_sharing.run([spec], sizes, runs=2, warmup=1, token_range=100, log_dir=tmp_path, results=results)
    assert {k: len(v["pocketllm-echo"]) for k, v in results.values.items()} == {
        "shared_ttft_p50_ms": 2, "shared_ttft_p99_ms": 2, "shared_tok_s": 2, "shared_hit_rate": 2,
        "shared_peak_rss_mb": 1}
    assert results.values["shared_hit_rate"]["pocketllm-echo"] == [0.0, 0.0]  # echo has no prefix cache
    assert [f.key for f in results.figures][-1] == "shared_peak_rss_mb"
