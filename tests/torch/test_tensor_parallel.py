"""Tensor parallelism on the torch backend over gloo: TP=2 generates what TP=1 does, how weights split, what is
refused. The ranks here are the library's own (LLM(tensor_parallel_size=2) starts rank 1 as a child process);
tests/server/test_tensor_parallel.py launches them through the supervisor and torchrun."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from pocketllm import LLM, PoolingParams, SamplingParams
from pocketllm.errors import UnsupportedOptionError
from pocketllm.testing.checkpoints import write_checkpoint
from tests.conftest import requires_default_model

pytest.importorskip("pocketllm_torch")

import torch

from pocketllm.model_config import ModelConfig
from pocketllm_torch.groups import Int4Groups
from pocketllm_torch.weight_split import Split, _take

CONFIG = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _greedy(path: str, tp: int, **kwargs: object) -> list[list[int]]:
    llm = LLM(path, backend="torch", dtype="float32", tensor_parallel_size=tp, **kwargs)
    try:
        prompts = [llm.tokenizer.encode("The capital of France is"), [5, 6, 7, 8, 9, 10], list(range(3, 60))]
        return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "llama-gguf", "default"])
def test_two_ranks_generate_what_one_does(kind: str, tmp_path: Path) -> None:
    """Each supported architecture, 8- and 4-bit grouped matrices (the kit's GGUF, the default model's Q4_1) and
    an uneven split of KV heads (the default model's 3 go 2 + 1)."""
    path = "smollm2-135m-instruct" if kind == "default" else str(write_checkpoint(kind, tmp_path))
    assert _greedy(path, 2) == _greedy(path, 1)


@pytest.mark.parametrize("kind", ["llama-cyclic", "qwen3_5-cyclic"])
def test_two_ranks_verify_drafts_as_one_rank_decodes(kind: str, tmp_path: Path) -> None:
    """ngram drafts verified on two ranks, in the hybrid with each rank committing its share of the accepted row's
    state (named in the next step): the tokens of one rank decoding without drafts, with drafts accepted."""
    from pocketllm.testing.protocol import LONG_PROMPT, PROMPTS

    path = str(write_checkpoint(kind, tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results, accepted = {}, 0
    for tp, spec in ((1, {}), (2, {"speculative_method": "ngram", "num_speculative_tokens": 4})):
        llm = LLM(path, backend="torch", dtype="float32", tensor_parallel_size=tp, **spec)
        try:
            results[tp] = [out.outputs[0].token_ids for out in llm.generate([LONG_PROMPT, *PROMPTS], params)]
            accepted = llm.stats().num_spec_accepted_tokens
        finally:
            llm.shutdown()
    assert results[2] == results[1]
    assert accepted > 0


def _logprobs(llm: LLM, prompts: list[str], tokens: int) -> list[list[tuple[int, float, list[tuple[int, float]]]]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=3))
    return [[(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in o.outputs[0].logprobs]
            for o in outs]


@requires_default_model
def test_two_ranks_give_the_logprobs_of_one() -> None:
    """64 greedy tokens of the default model on three prompts: the same tokens, logprobs within 1e-4, in float32
    (where both sides do the same arithmetic but for the order of the ranks' sums)."""
    prompts = ["The capital of France is", "Explain why the sky is blue.", "def fibonacci(n):"]
    results = {}
    for tp in (1, 2):
        llm = LLM("smollm2-135m-instruct", backend="torch", dtype="float32", tensor_parallel_size=tp)
        try:
            results[tp] = _logprobs(llm, prompts, 64)
        finally:
            llm.shutdown()
    for one, two in zip(results[1], results[2], strict=True):
        assert [t for t, _, _ in two] == [t for t, _, _ in one]
        for (_, lp1, top1), (_, lp2, top2) in zip(one, two, strict=True):
            assert abs(lp1 - lp2) < 1e-4
            assert [t for t, _ in top2] == [t for t, _ in top1]
            assert max(abs(a - b) for (_, a), (_, b) in zip(top1, top2, strict=True)) < 1e-4


@requires_default_model
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_keep_float32_in_the_default_dtype(tp: int) -> None:
    """bf16 activations (the default dtype where the CPU has bf16 instructions) still give float32 logits: the LM
    head's 8-bit kernel computes them in float32, and rank 0 gathers them so. Rounded to bf16 (0.125 apart at
    the default model's logits), near-ties became exact ties: a few in 64 tokens of three prompts."""
    llm = LLM("smollm2-135m-instruct", backend="torch", tensor_parallel_size=tp)
    try:
        if tp == 1:  # at TP=2 the head is a collective, which only the engine's steps may run
            model = llm.backend_engine.runner.model
            hidden = torch.randn(4, llm.model_config.hidden_size, generator=torch.Generator().manual_seed(0))
            logits = model.compute_logits(hidden.to(model.dtype))
            assert logits.dtype == torch.float32 and not torch.equal(logits, logits.bfloat16().float())
        positions = [p for out in _logprobs(llm, ["The capital of France is", "Explain why the sky is blue.",
                                                  "def fibonacci(n):"], 64) for p in out]
        assert not [top for _, _, top in positions if top[0][1] == top[1][1]], "top-2 logprobs tie exactly"
    finally:
        llm.shutdown()


def test_two_ranks_embed_what_one_does_beside_a_generation(tmp_path: Path) -> None:
    """Rank 0 pools the replicated hidden states; the other ranks run the same forward passes as for generation."""
    path = str(write_checkpoint("llama", tmp_path))
    results = {}
    for tp in (1, 2):
        llm = LLM(path, backend="torch", dtype="float32", tensor_parallel_size=tp)
        try:
            stream = llm.generate_stream([5, 6, 7, 8], GREEDY)
            tokens = next(stream).token_ids
            mean = PoolingParams(pooling_type="mean")
            vectors = [o.embedding for o in llm.embed(["the cat sat", list(range(3, 60))], mean)]
            results[tp] = vectors, tokens + [t for e in stream for t in e.token_ids]
        finally:
            llm.shutdown()
    assert results[2][1] == results[1][1]
    for ours, theirs in zip(results[2][0], results[1][0], strict=True):
        assert np.abs(np.array(ours) - np.array(theirs)).max() < 1e-5


def test_two_ranks_with_prefix_caching_and_preemption(tmp_path: Path) -> None:
    path = str(write_checkpoint("llama", tmp_path))
    options = {"enable_prefix_caching": True, "max_num_seqs": 2, "backend_options": {"block_size": 4}}
    assert _greedy(path, 2, **options) == _greedy(path, 1, **options)


def test_the_split_follows_kv_heads_and_stays_in_whole_groups() -> None:
    halves = [Split.of(CONFIG, rank, 2) for rank in range(2)]  # 4 query heads, 2 KV heads of 16
    assert [s.local["num_key_value_heads"] for s in halves] == [1, 1]
    assert list(halves[1].parts["q"]) == list(range(32, 64)) and list(halves[1].parts["kv"]) == list(range(16, 32))
    assert list(halves[0].parts["ff"]) == list(range(64))  # 128 features: two whole 32-column groups each
    nine = msgspec.structs.replace(CONFIG, num_key_value_heads=3, num_attention_heads=9, head_dim=32)
    uneven = [Split.of(nine, rank, 2) for rank in range(2)]
    assert [s.local["num_attention_heads"] for s in uneven] == [6, 3]
    assert [len(s.parts["o"]) for s in uneven] == [192, 96]
    codes = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64) % 16
    groups = Int4Groups(codes, np.ones((4, 2), np.float32), np.zeros((4, 2), np.float32))
    right = _take(groups, np.arange(32, 64), 1, "w")
    assert right.codes.shape == (4, 32) and right.scale.shape == (4, 1) and (right.codes == codes[:, 32:]).all()
    assert _take(groups, np.arange(1, 3), 0, "w").offset.shape == (2, 2)
    with pytest.raises(UnsupportedOptionError, match="32-column groups"):
        _take(groups, np.arange(16, 48), 1, "blk.0.attn_output.weight")


def test_gated_deltanet_value_heads_follow_their_key_heads_in_either_order() -> None:
    hybrid = msgspec.structs.replace(CONFIG, architecture="qwen3_5_text", extra={
        "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_key_head_dim": 4,
        "linear_value_head_dim": 2})
    grouped, tiled = Split.of(hybrid, 1, 2), Split.of(hybrid, 1, 2, tiled_values=True)
    assert list(grouped.parts["v_heads"]) == [3, 4, 5] and list(tiled.parts["v_heads"]) == [1, 3, 5]
    # q rows of key head 1, k rows of key head 1, then the value rows of its heads
    assert list(grouped.parts["qkv"]) == [4, 5, 6, 7, 12, 13, 14, 15, *range(16 + 6, 16 + 12)]
    assert grouped.local_config(hybrid).extra["linear_num_value_heads"] == 3


def test_what_cannot_be_split_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedOptionError, match=r"tensor_parallel_size.*only 2 KV heads"):
        Split.of(CONFIG, 0, 4)
    with pytest.raises(UnsupportedOptionError, match=r"tensor_parallel_size.*mistral"):
        Split.of(msgspec.structs.replace(CONFIG, architecture="mistral"), 0, 2)


@pytest.mark.parametrize("form", ["dense", "moe", "dense-gguf", "moe-gguf"])
def test_qwen3_5_on_two_ranks_generates_what_one_does_and_its_snapshots_hit(form: str, tmp_path: Path) -> None:
    """Gated DeltaNet heads (grouped, or tiled in the GGUF form) and experts split; a request resuming from a
    state snapshot restores every rank's share of it."""
    pytest.importorskip("transformers")
    from pocketllm.testing.checkpoints import _write_tokenizer
    from tests.torch.qwen3_5_kit import tiny_qwen3_5, to_gguf

    hf, path = tiny_qwen3_5(tmp_path / "hf", moe=form.startswith("moe"))
    _write_tokenizer(path)
    model = str(to_gguf(hf, tmp_path / "model.gguf") if form.endswith("gguf") else path)
    shared = list(range(3, 80))
    results = {}
    for tp in (1, 2):
        llm = LLM(model, backend="torch", dtype="float32", tensor_parallel_size=tp, enable_prefix_caching=True,
                  prefill_chunk_size=24, backend_options={"block_size": 8})
        try:
            first = llm.generate([[*shared, 5, 6]], GREEDY)
            rest = llm.generate([[*shared, 9, 10, 11], list(range(100, 140))], GREEDY)
            results[tp] = [out.outputs[0].token_ids for out in first + rest]
            assert llm.stats().num_state_snapshot_hits == 1
        finally:
            llm.shutdown()
    assert results[2] == results[1]


def test_a_process_holds_one_tensor_parallel_engine_and_rank_1_no_engine(tmp_path: Path, monkeypatch) -> None:
    from pocketllm.errors import ConfigError

    path = str(write_checkpoint("llama", tmp_path))
    llm = LLM(path, backend="torch", dtype="float32", tensor_parallel_size=2)
    try:
        with pytest.raises(ConfigError, match="already holds a tensor-parallel engine"):
            LLM(path, backend="torch", dtype="float32", tensor_parallel_size=2)
    finally:
        llm.shutdown()
    assert "RANK" not in __import__("os").environ  # the library's ranks leave the environment as they found it
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="rank 1: ranks other than 0"):
        LLM(path, backend="torch", dtype="float32", tensor_parallel_size=2)
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="WORLD_SIZE=3"):
        LLM(path, backend="torch", dtype="float32", tensor_parallel_size=2)


def test_a_library_rank_that_dies_before_joining_is_an_error_not_a_hang(tmp_path: Path, monkeypatch) -> None:
    import os
    import time

    from pocketllm.errors import EngineDeadError

    # Rank 1's interpreter imports this sitecustomize, which exits before the rank can join rank 0.
    (tmp_path / "sitecustomize.py").write_text(
        "import os\nif os.environ.get('RANK') == '1':\n    print('rank 1: no device here')\n    os._exit(4)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"rank 1 exited with code 4(.|\n)*no device here"):
        LLM(str(write_checkpoint("llama", tmp_path / "model")), backend="torch", dtype="float32",
            tensor_parallel_size=2)
    assert time.monotonic() - started < 60 and "RANK" not in os.environ


def test_an_engine_built_on_a_thread_outlives_the_thread(tmp_path: Path) -> None:
    import threading

    path = str(write_checkpoint("llama", tmp_path))
    built: list[LLM] = []
    thread = threading.Thread(target=lambda: built.append(LLM(path, backend="torch", dtype="float32",
                                                               tensor_parallel_size=2)))
    thread.start()
    thread.join()
    [llm] = built
    try:
        assert len(llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.shutdown()
