"""Speculative decoding with Qwen3.5's multi-token-prediction head, on each backend: a head fitted to the model's
own greedy outputs is accepted often and changes no token (greedy or seeded), from safetensors and from llama.cpp's
converter's GGUF alike; an MoE head, preemption and prefix caching change nothing; a checkpoint without a head, or
with a broken one, is refused at load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pocketllm import LLM, SamplingParams
from pocketllm.errors import CheckpointError, UnsupportedOptionError
from pocketllm.testing.checkpoints import _write_tokenizer
from tests.torch.qwen3_5_kit import _add_mtp_layer, convert_with_llama_cpp, fit_mtp_head, tiny_qwen3_5, to_gguf
from tests.torch.torch_testkit import VOCAB

pytest.importorskip("pocketllm_torch")  # the tests' checkpoints come from transformers, on torch

MTP = {"speculative_method": "mtp", "num_speculative_tokens": 3}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, ignore_eos=True, seed=7)


def prompts(count: int, offset: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(offset)
    return [torch.randint(3, VOCAB, (12,), generator=g).tolist() for _ in range(count)]


# Each backend in float32 arithmetic (the cpp engine's default 8-bit activations would do as well: every comparison
# here is with the same backend without drafts).
ARITHMETIC = {"torch": ({"dtype": "float32"}, {}),
              "cpp": ({"kv_cache_dtype": "float32"}, {"exact_activations": True})}


@pytest.fixture(params=list(ARITHMETIC))
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def make(path: Path, backend: str, *, backend_options: dict[str, object] | None = None, **kwargs: object) -> LLM:
    if path.is_dir():
        _write_tokenizer(path)  # the kit's, which LLM needs and tiny_qwen3_5 does not write
    args, options = ARITHMETIC[backend]
    return LLM(str(path), backend=backend, backend_options={**options, **(backend_options or {})}, **args, **kwargs)


def outputs(llm: LLM, requests: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.generate(requests, [params] * len(requests))]


def fitted_on() -> list[list[int]]:
    return prompts(24, offset=0)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3.5 whose head was fitted to its greedy continuations of 24 prompts (300 steps)."""
    hf, path = tiny_qwen3_5(tmp_path_factory.mktemp("fitted") / "hf")
    fit_mtp_head(hf, path, fitted_on())
    return path


def acceptance(llm: LLM) -> float:
    stats = llm.stats()
    return stats.num_spec_accepted_tokens / stats.num_spec_draft_tokens


def test_a_fitted_head_is_accepted_often_and_changes_no_token(fitted: Path, backend: str) -> None:
    """Greedy and seeded outputs are those without drafts (a draft is drawn with the target's noise and kept only
    where the target's own draw is it), and on the prompts the head was fitted to most drafts are accepted (a
    random model's continuations of other prompts are not what 24 of them teach)."""
    plain, spec = make(fitted, backend), make(fitted, backend, **MTP)
    try:
        requests = fitted_on()[:6]
        assert outputs(spec, requests) == outputs(plain, requests)
        greedy_rate = acceptance(spec)
        assert outputs(spec, requests, SEEDED) == outputs(plain, requests, SEEDED)
        stats = spec.stats()
        print(f"accepted {stats.num_spec_accepted_tokens} of {stats.num_spec_draft_tokens} drafted tokens "
              f"(greedy alone: {greedy_rate:.2f}); per position {stats.spec_accepted_per_position}")
        assert greedy_rate > 0.6
        assert stats.spec_accepted_per_position[0] > stats.num_spec_drafts // 2
    finally:
        plain.shutdown()
        spec.shutdown()


def test_the_converter_s_gguf_of_the_fitted_head_drafts_as_the_safetensors_do(fitted: Path, llama_cpp: Path,
                                                                              tmp_path: Path, backend: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py writes the head as blk.<n>.* and blk.<n>.nextn.*, its norms as 1 + w:
    the GGUF's drafts are accepted as often, and change nothing."""
    source = tmp_path / "hf"
    shutil.copytree(fitted, source)
    gguf = convert_with_llama_cpp(llama_cpp, source, tmp_path / "model.gguf", add_mtp=False)
    requests = fitted_on()[:6]
    plain, from_gguf, from_hf = make(gguf, backend), make(gguf, backend, **MTP), make(fitted, backend, **MTP)
    try:
        assert outputs(from_gguf, requests) == outputs(plain, requests) == outputs(from_hf, requests)
        assert acceptance(from_gguf) == pytest.approx(acceptance(from_hf), abs=0.05)
    finally:
        for llm in (plain, from_gguf, from_hf):
            llm.shutdown()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_random_head_changes_nothing_under_preemption_and_prefix_caching(tmp_path: Path, moe: bool,
                                                                           backend: str) -> None:
    """A head copied from the model's attention layer (drafts mostly rejected, the MoE one routing its tokens):
    a batch that does not fit the KV cache (preemptions recompute the head's keys and values) and a shared
    prefix give the tokens of plain decoding."""
    _, path = tiny_qwen3_5(tmp_path / "hf", moe=moe, shared_expert_ff=64)  # rows of 32s, as cpp takes
    _add_mtp_layer(path)
    shared = prompts(1, offset=3)[0] * 3
    requests = [*prompts(6, offset=2), *[shared + p for p in prompts(3, offset=4)]]
    plain = make(path, backend)
    expected = outputs(plain, requests)
    plain.shutdown()
    for kwargs in ({"backend_options": {"num_kv_blocks": 12}, "max_model_len": 128}, {"enable_prefix_caching": True}):
        spec = make(path, backend, **MTP, **kwargs)
        try:
            assert outputs(spec, requests[:7]) + outputs(spec, requests[7:]) == expected  # the second call hits
            stats = spec.stats()
            assert stats.num_spec_draft_tokens > 0
            assert stats.num_preemptions > 0 if "backend_options" in kwargs else stats.num_prefix_cache_hits > 0
        finally:
            spec.shutdown()


def test_a_checkpoint_without_a_head_or_with_a_broken_one_is_refused(tmp_path: Path, backend: str) -> None:
    hf, path = tiny_qwen3_5(tmp_path / "hf")
    with pytest.raises(UnsupportedOptionError, match=r"speculative_method.*has none"):
        make(path, backend, **MTP)
    # The kit's converter adds only a part of a head (its projection and one norm).
    with pytest.raises(CheckpointError, match=r"checkpoint has no (weight|tensor)"):
        make(to_gguf(hf, tmp_path / "partial.gguf", mtp_layers=1), backend, **MTP)
    _add_mtp_layer(path)
    if backend == "torch":  # cpp has no tensor parallelism at all
        with pytest.raises(UnsupportedOptionError, match="tensor_parallel_size"):
            make(path, backend, tensor_parallel_size=2, **MTP)
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    weights["mtp.fc.weight"] = weights["mtp.fc.weight"][:, :-1].contiguous()
    save_file(weights, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight.*hidden_size"):
        make(path, backend, **MTP)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_5_text"
