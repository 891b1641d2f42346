"""Qwen3.5 served by the cpp engine (state slots per request, snapshots for prefix caching) against transformers'
greedy ids, dense and MoE: batched with chunked prefill and a token budget, preempted, and resumed from a cached
prefix, with every block and slot given back."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("pocketllm_cpp._native")
pytest.importorskip("transformers")

from pocketllm import LLM, SamplingParams
from pocketllm.errors import UnsupportedOptionError
from pocketllm.plugins import BackendRegistry
from pocketllm.testing import GatedBackend
from pocketllm.testing.checkpoints import _write_tokenizer
from tests.torch.qwen3_5_kit import tiny_qwen3_5
from tests.torch.torch_testkit import hf_greedy, prompt

LENGTHS = (3, 17, 70, 130)
TOKENS = 24
EXACT = {"backend": "cpp", "backend_options": {"exact_activations": True, "block_size": 16},
         "kv_cache_dtype": "float32", "max_model_len": 256}


@pytest.fixture(scope="module", params=["dense", "moe"])
def qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(checkpoint directory, transformers' greedy ids per prompt length)."""
    hf, path = tiny_qwen3_5(tmp_path_factory.mktemp(request.param) / "hf", moe=request.param == "moe",
                            shared_expert_ff=64)
    _write_tokenizer(path)
    return path, {n: hf_greedy(hf, prompt(n, offset=n), TOKENS) for n in LENGTHS}


def _generate(llm: LLM) -> dict[int, list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    outputs = llm.generate([prompt(n, offset=n) for n in LENGTHS], params)
    return {n: list(out.outputs[0].token_ids) for n, out in zip(LENGTHS, outputs, strict=True)}


def _generate_together(llm: LLM, gated: GatedBackend) -> dict[int, list[int]]:
    """_generate with every prompt in the engine before its first step: the schedule (and so whether the KV
    cache runs short) does not depend on how the engine thread's steps fall between the adds."""
    gated.gate.hold()
    result: dict[int, list[int]] = {}
    worker = threading.Thread(target=lambda: result.update(_generate(llm)))
    worker.start()
    try:
        assert gated.gate.wait_added(len(LENGTHS))
    finally:
        gated.gate.open()
        worker.join()
    return result


@pytest.mark.parametrize("engine", [
    {"max_num_seqs": 4, "prefill_chunk_size": 32, "max_num_batched_tokens": 48},
    {"max_num_seqs": 2, "enable_prefix_caching": False},
    # Every prompt's blocks fit at once (1 + 2 + 5 + 9 of 18), not their growth: one is preempted.
    {"max_num_seqs": 4, "backend_options": {**EXACT["backend_options"], "num_kv_blocks": 18}},
], ids=["chunked", "two-slots", "preempting"])
def test_greedy_ids_match_transformers(qwen, engine: dict) -> None:
    path, reference = qwen
    registry = BackendRegistry()
    gated = GatedBackend.install(registry, "cpp")
    llm = LLM(str(path), **(EXACT | engine | {"backend": gated.name}), registry=registry)
    try:
        assert _generate_together(llm, gated) == reference
        stats = llm.stats()
        assert stats.num_running == 0 and stats.num_kv_blocks_used == 0
        assert (stats.num_preemptions > 0) == ("num_kv_blocks" in engine.get("backend_options", {}))
    finally:
        llm.shutdown()


def test_a_prompt_s_bits_do_not_depend_on_the_budget_it_shares(qwen) -> None:
    """With a 40-token budget, a 50-token prompt beside a 30-token one cannot end its first chunk on a 16-token
    boundary of the delta rule's chunks: it waits a step rather than split there, and samples the tokens, with the
    same log-probabilities to the bit, that it samples alone."""
    path, _ = qwen
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True, logprobs=1)
    engine = EXACT | {"max_num_batched_tokens": 40, "prefill_chunk_size": 64, "enable_prefix_caching": False}

    def sampled(outputs) -> list:
        return [(o.outputs[0].token_ids, [(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs])
                for o in outputs]

    llm = LLM(str(path), **engine)
    try:
        alone = sampled(llm.generate([prompt(50, offset=2)], params))
    finally:
        llm.shutdown()
    registry = BackendRegistry()
    gated = GatedBackend.install(registry, "cpp")
    llm = LLM(str(path), **(engine | {"backend": gated.name}), registry=registry)
    try:
        gated.gate.hold()
        result: list = []
        worker = threading.Thread(target=lambda: result.extend(
            sampled(llm.generate([prompt(30, offset=1), prompt(50, offset=2)], params))))
        worker.start()
        try:
            assert gated.gate.wait_added(2)
        finally:
            gated.gate.open()
            worker.join()
    finally:
        llm.shutdown()
    assert result[1] == alone[0]


def test_a_cached_prefix_resumes_from_its_snapshot(qwen) -> None:
    """The second run of the same prompts resumes each from a snapshot at a block boundary of its prompt (the
    prefix cache's blocks with the states that end there) and gives the cold run's ids."""
    path, reference = qwen
    llm = LLM(str(path), **EXACT, enable_prefix_caching=True, prefill_chunk_size=32)
    try:
        assert _generate(llm) == reference
        cold = llm.stats()
        assert cold.num_state_snapshots > 0 and cold.num_state_snapshot_hits == 0
        assert _generate(llm) == reference
        warm = llm.stats()
        assert warm.num_state_snapshot_hits == 3  # the three prompts of a full block or more
        assert warm.num_prefix_cache_hits > cold.num_prefix_cache_hits
    finally:
        llm.shutdown()


def test_a_prefix_resumes_from_a_snapshot_taken_inside_a_prompt_chunk(qwen) -> None:
    """A 130-token prompt in one chunk leaves states at 64 (taken inside the pass) and at its last boundary 128; a
    prompt sharing its first 100 tokens resumes from the one at 64 and gives the ids it gives cold."""
    path, _ = qwen
    first = prompt(130, offset=130)
    sharing = first[:100] + prompt(20, offset=3)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine = EXACT | {"prefill_chunk_size": 256}
    llm = LLM(str(path), **engine, enable_prefix_caching=False)
    try:
        cold = llm.generate([sharing], params)[0].outputs[0].token_ids
    finally:
        llm.shutdown()
    llm = LLM(str(path), **engine, enable_prefix_caching=True)
    try:
        llm.generate([first], params)
        assert llm.stats().num_state_snapshots == 2
        assert llm.generate([sharing], params)[0].outputs[0].token_ids == cold
        assert llm.stats().num_state_snapshot_hits == 1
    finally:
        llm.shutdown()


def test_auto_picks_cpp_for_qwen3_5(qwen) -> None:
    from pocketllm_cpp import _native

    path, _ = qwen
    llm = LLM(str(path), max_model_len=64)
    try:
        assert llm.backend_engine.__class__.__module__.startswith(
            "pocketllm_cpp" if _native.best_isa() in ("avx2", "avx512", "amx") else "pocketllm_torch")
    finally:
        llm.shutdown()


def test_rows_the_kernels_cannot_block_are_refused_naming_the_tensor(tmp_path) -> None:
    """The kit's default shared expert is 48 wide: its down projection's rows do not divide into 32-value blocks."""
    _, path = tiny_qwen3_5(tmp_path / "hf", moe=True, shared_expert_ff=48)
    _write_tokenizer(path)
    with pytest.raises(UnsupportedOptionError, match=r"'cpp'.*shared_expert\.down_proj.*rows of 48 values"):
        LLM(str(path), backend="cpp", max_model_len=64)
