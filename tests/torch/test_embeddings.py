"""Embeddings on the torch backend against transformers' pooled final hidden states (after the last norm)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pocketllm import LLM, CheckpointError, PoolingParams, PromptTooLongError, SamplingParams, UnsupportedOptionError
from pocketllm.checkpoint import load_checkpoint
from tests.conftest import requires_default_model

torch = pytest.importorskip("torch")
pytest.importorskip("pocketllm_torch")
TEXTS = ["What is the capital of France?", "The quick brown fox jumps over the lazy dog, twice, and then a third time.",
         "What is the capital of France?", "1 2 3"]


def reference(hf, ids: list[int], kind: str) -> torch.Tensor:
    """transformers' pooling: its base model's last_hidden_state is after the final norm."""
    with torch.inference_mode():
        states = hf.model(torch.tensor([ids])).last_hidden_state[0].float()
    vector = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[kind]
    return torch.nn.functional.normalize(vector, dim=0)


def assert_close(ours: list[float], theirs: torch.Tensor, tolerance: float = 1e-4) -> None:
    worst = (torch.tensor(ours) - theirs).abs().max().item()
    assert worst <= tolerance, f"differs from transformers by {worst}"


@requires_default_model
def test_default_model_embeddings_equal_transformers_pooling() -> None:
    transformers = pytest.importorskip("transformers")
    llm = LLM("smollm2-135m-instruct", backend="torch", dtype="float32", show_progress=False)
    try:
        path = llm.checkpoint_path
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=torch.float32).eval()
        for kind in ("last", "mean"):
            outs = llm.embed(TEXTS, PoolingParams(pooling_type=kind))
            for out in outs:
                assert len(out.embedding) == llm.model_config.hidden_size
                assert_close(out.embedding, reference(hf, out.prompt_token_ids, kind))
            # Identical inputs: bit for bit when they run alone; within rounding when the batch around them differs
            # (which requests share a step depends on when each reached the engine thread).
            alone = llm.embed(TEXTS[1], PoolingParams(pooling_type=kind))[0].embedding
            assert llm.embed(TEXTS[1], PoolingParams(pooling_type=kind))[0].embedding == alone
            assert_close(outs[2].embedding, torch.tensor(outs[0].embedding), 1e-5)
            assert_close(alone, torch.tensor(outs[1].embedding), 1e-5)
        # The model's default: a GGUF without pooling_type pools the last token, as vLLM does for decoder models.
        assert llm.embed(TEXTS[0])[0].embedding == llm.embed(TEXTS[0], PoolingParams(pooling_type="last"))[0].embedding
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("transformers")
    from tests.torch.qwen3_5_kit import tiny_qwen3_5, to_gguf

    directory = tmp_path_factory.mktemp("qwen3_5")
    hf, _ = tiny_qwen3_5(directory / "hf")
    return hf, to_gguf(hf, directory / "model.gguf")  # the GGUF carries a tokenizer


def test_hybrid_model_embeddings_equal_transformers_in_chunks_and_with_prefix_caching(qwen) -> None:
    """Qwen3.5's Gated DeltaNet layers carry state across prompt chunks: pooling over chunks (and a last-token
    pooling resumed from a cached prefix's snapshot) equals transformers on the whole prompt."""
    hf, path = qwen
    prompts = [[(7 * i + 3) % 200 + 2 for i in range(n)] for n in (5, 37, 70)]
    llm = LLM(str(path), backend="torch", dtype="float32", prefill_chunk_size=16, max_num_batched_tokens=32,
              enable_prefix_caching=True, show_progress=False)
    try:
        for kind in ("mean", "last", "cls"):
            for out in llm.embed(prompts, PoolingParams(pooling_type=kind)):
                assert_close(out.embedding, reference(hf, out.prompt_token_ids, kind))
        before = llm.stats().num_prefix_cache_hits
        [again] = llm.embed(prompts[2], PoolingParams(pooling_type="last"))
        assert llm.stats().num_prefix_cache_hits > before
        assert_close(again.embedding, reference(hf, prompts[2], "last"))
    finally:
        llm.shutdown()


def test_embeddings_batch_with_generation_and_free_everything(pocketllm_tiny_llama: Path) -> None:
    llm = LLM(str(pocketllm_tiny_llama), backend="torch", dtype="float32", max_num_seqs=3, show_progress=False)
    try:
        greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        expected = llm.generate("the cat sat", greedy)[0].outputs[0].token_ids
        alone = [o.embedding for o in llm.embed(TEXTS)]
        stream = llm.generate_stream("the cat sat", greedy)
        tokens = next(stream).token_ids
        beside = llm.embed(TEXTS * 3)  # more than max_num_seqs: they queue behind the generation's slot
        tokens += [t for event in stream for t in event.token_ids]
        assert tokens == expected
        for i, out in enumerate(beside):
            assert_close(out.embedding, torch.tensor(alone[i % len(TEXTS)]), 1e-5)
        stats = llm.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)
    finally:
        llm.shutdown()


def test_embedding_errors_are_typed_and_leave_the_engine_serving(pocketllm_tiny_llama: Path) -> None:
    llm = LLM(str(pocketllm_tiny_llama), backend="torch", dtype="float32", max_model_len=32, show_progress=False)
    try:
        width = llm.model_config.hidden_size
        assert len(llm.embed([5] * 32)[0].embedding) == width  # a whole context: nothing is generated after it
        with pytest.raises(PromptTooLongError):
            llm.embed([5] * 33)
        with pytest.raises(UnsupportedOptionError) as err:
            llm.embed("hi", PoolingParams(dimensions=8))
        assert err.value.option == "dimensions"
        assert len(llm.embed("hi", PoolingParams(dimensions=width))[0].embedding) == width
        with pytest.raises(ValueError, match="pooling_type"):
            llm.embed("hi", PoolingParams(pooling_type="max"))
        assert llm.embed("hi")[0].embedding
    finally:
        llm.shutdown()


def test_checkpoint_pooling_config_is_the_default(pocketllm_tiny_llama: Path, tmp_path: Path) -> None:
    """sentence-transformers' modules.json and 1_Pooling/config.json choose the pooling a request leaves open."""
    import shutil

    model = tmp_path / "st"
    shutil.copytree(pocketllm_tiny_llama, model)
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert load_checkpoint(str(model)).pooling_type() == "mean"
    llm = LLM(str(model), backend="torch", dtype="float32", show_progress=False)
    try:
        assert llm.embed("hello")[0].embedding == llm.embed("hello", PoolingParams(pooling_type="mean"))[0].embedding
    finally:
        llm.shutdown()
    (model / "modules.json").write_text("[{")
    with pytest.raises(CheckpointError, match=r"modules\.json"):
        load_checkpoint(str(model)).pooling_type()
    # A broken pooling config fails the embeddings that rely on it, not the model's loading or generation.
    llm = LLM(str(model), backend="torch", dtype="float32", show_progress=False)
    try:
        with pytest.raises(CheckpointError, match=r"modules\.json"):
            llm.embed("hello")
        assert llm.embed("hello", PoolingParams(pooling_type="mean"))[0].embedding
        assert llm.generate("hello", SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    pooling = {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    (model / "modules.json").write_text(json.dumps([pooling]))
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_max_tokens": True}))
    llm = LLM(str(model), backend="torch", dtype="float32", show_progress=False)
    try:
        with pytest.raises(ValueError, match="the checkpoint pools with 'max'"):
            llm.embed("hello")
    finally:
        llm.shutdown()
