"""Our Llama/Qwen3 against transformers on tiny random fp32 models: logits, then greedy ids through the engine."""

from __future__ import annotations

import pytest
import torch

from tests.torch.torch_testkit import greedy, hf_greedy, make_engine, prompt, run_to_completion, tiny_model

pytest.importorskip("transformers")

from pocketllm_torch.attention import KVCache, build_metadata
from pocketllm_torch.context import StepContext
from pocketllm_torch.models import model_class

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def our_logits(checkpoint, prompts: list[list[int]], block_size: int = 4, dtype: torch.dtype = torch.float32,
               groups: bool = False) -> list[torch.Tensor]:
    """Logits of every prompt position, all prompts prefilled in one batch over a paged cache."""
    config = checkpoint.config
    weights = checkpoint.weights(grouped=groups)
    model = model_class(config.architecture).from_weights(config, weights, torch.device("cpu"), dtype, 256)
    cache = KVCache(config.num_hidden_layers, 200, block_size, config.num_key_value_heads, config.head_dim,
                    model.dtype, torch.device("cpu"))
    # Interleaved, out-of-order blocks: the cache layout must not assume contiguity.
    tables = [list(range(1 + i, 200, len(prompts)))[::-1] for i in range(len(prompts))]
    cache.blocks[:, :, :, 1:].fill_(float("nan"))  # what torch.empty may hand back: must never reach the output
    cache.zero_new_blocks(tables)
    positions, meta = build_metadata([0] * len(prompts), [len(p) for p in prompts], tables, block_size,
                                     torch.device("cpu"), model.dtype)
    with torch.inference_mode():
        ctx = StepContext(positions, meta, cache.layers, [len(p) for p in prompts], None)
        hidden = model(torch.tensor([t for p in prompts for t in p]), ctx)
        logits = model.compute_logits(hidden)
    return list(logits.split([len(p) for p in prompts]))


@pytest.mark.parametrize(("arch", "tie", "rope_scaling"), [
    ("llama", True, None), ("llama", False, None), ("llama", False, LLAMA3_SCALING), ("qwen3", False, None),
])
def test_logits_match_transformers(arch: str, tie: bool, rope_scaling: dict | None) -> None:
    hf, checkpoint = tiny_model(arch, tie=tie, rope_scaling=rope_scaling)
    prompts = [prompt(37), prompt(5, offset=1), prompt(90, offset=2)]
    for ids, ours in zip(prompts, our_logits(checkpoint, prompts), strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours - ref).abs().max().item() <= 1e-3


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", tie=True, layers=3)


@pytest.fixture(scope="module")
def reference(llama) -> dict[int, list[int]]:
    """transformers' greedy 32 tokens for prompts of several lengths."""
    hf, _ = llama
    return {n: hf_greedy(hf, prompt(n, offset=n), 32) for n in (3, 17, 40, 75)}


@pytest.mark.parametrize("engine_args", [
    {},
    {"prefill_chunk_size": 7},
    {"max_num_batched_tokens": 20, "prefill_chunk_size": 16},
    {"backend_options": {"block_size": 4, "num_kv_blocks": 40}},  # too few blocks for all four: preemption
], ids=["batched", "chunked", "token-budget", "preempted"])
def test_greedy_ids_match_transformers(llama, reference: dict[int, list[int]], engine_args: dict) -> None:
    _, checkpoint = llama
    engine = make_engine(checkpoint, max_model_len=128, **engine_args)
    outputs = run_to_completion(engine, {str(n): (prompt(n, offset=n), greedy(32)) for n in reference})
    assert outputs == {str(n): ids for n, ids in reference.items()}
    stats = engine.stats()
    assert (stats.num_kv_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)
    if "num_kv_blocks" in engine_args.get("backend_options", {}):
        assert stats.num_preemptions > 0


def test_qwen3_greedy_ids_match_transformers() -> None:
    hf, checkpoint = tiny_model("qwen3")
    ids = prompt(21)
    outputs = run_to_completion(make_engine(checkpoint, prefill_chunk_size=8), {"q": (ids, greedy(24))})
    assert outputs["q"] == hf_greedy(hf, ids, 24)

