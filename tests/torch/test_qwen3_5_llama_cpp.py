"""Qwen3.5 GGUFs made by llama.cpp itself (convert_hf_to_gguf.py from the llama-cpp-python sdist, then llama-quantize to
Q8_0 and Q4_K) against llama.cpp (llama-cpp-python on the same file): each backend that serves Qwen3.5 loads every
file and, on the F32 and Q8_0 files, generates llama.cpp's greedy ids wherever the fp32 reference's top-2 margin is
clear.

How the prompts and margins are chosen:

- Checkpoints: the kit's tiny Qwen3.5, dense and MoE (its shared expert 64 wide: the cpp kernels take rows in
  blocks of 32), with its irregular layer mix and a multi-token-prediction layer, weights drawn with std 0.045
  instead of the kit's 0.15. At 0.15 the random layers amplify rounding
  (llama.cpp rounds a Q8_0 product's activations to 8 bits too) into logit errors as large as the margins
  themselves: llama.cpp on the Q8_0 file chose another token than the reference at margins up to 0.87 (of a median
  0.31); at 0.045, up to 0.06 dense and 0.10 MoE (of a median 0.08), over 256 positions each.
- Prompts: the kit's fixed token-id prompts of 3, 17, 40 and 70 tokens (as in test_qwen3_5.py; chosen before any
  engine ran, not by outcome). Reference: transformers' fp32 greedy 32 tokens and its top-2 margin at each.
- Free-running: the engine's and llama.cpp's 32 greedy ids equal the reference's up to their first difference,
  which must fall where the margin is below the file's threshold (past a near-tie the paths may part).
- Teacher-forced: at each position of the reference continuation whose margin is at least the threshold, one greedy
  token after that prefix, from both, is the reference's; at least 8 such positions per file.
- Thresholds: F32 0.01, nine times the largest logit difference measured between llama.cpp and transformers on
  these F32 files (0.0011 over 256 positions; llama.cpp keeps its KV cache in float16); Q8_0 0.25, 2.5 times the
  largest margin at which either engine's token differed from the reference's on the Q8_0 files. That leaves about
  120 of the 128 positions clear on the F32 files, 12 to 14 on the Q8_0 ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from pocketllm import LLM, SamplingParams
from pocketllm.checkpoint import load_checkpoint
from tests.llama_cpp_tools import Reference, llama_cpp, llama_cpp_greedy, llama_quantize, reference_greedy
from tests.torch.qwen3_5_kit import (
    IRREGULAR_LAYERS,
    LLAMA_CPP_SDIST,
    convert_with_llama_cpp,
    llama_cpp_converter,
    tiny_qwen3_5,
)
from tests.torch.torch_testkit import prompt

STD = 0.045
PROMPTS = [prompt(n, offset=n) for n in (3, 17, 40, 70)]
TOKENS = 32
THRESHOLDS = {"F32": 0.01, "Q8_0": 0.25}
MIN_CLEAR_POSITIONS = 8
# What llama-quantize makes of the kit's matrices, whose rows (64 or 128 wide) do not divide into Q4_K's 256-weight
# super-blocks: it falls back per tensor (Q4_K -> Q5_0, Q6_K -> Q8_0); norms, the convolution, ssm_a and the routers
# stay float32. A 256-wide checkpoint keeps real Q4_K and Q6_K blocks; its shared expert, the kit's default 48 wide
# (no multiple of 32), has a down projection that falls back to F16.
STORAGE_TYPES = {"F32": {"F32"}, "Q8_0": {"F32", "Q8_0"}, "Q4_K": {"F32", "Q5_0", "Q8_0"},
                 "Q4_K, hidden 256": {"F16", "F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}}
SHARED_EXPERT_FF = 64


@dataclass(frozen=True)
class Files:
    """llama.cpp's files of one checkpoint (by type), and the fp32 reference on its prompts."""

    moe: bool
    gguf: dict[str, Path]
    references: list[Reference]


@pytest.fixture(scope="module")
def converter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    llama_cpp()  # skips where llama-cpp-python is missing: without it there is nothing to compare with
    found = llama_cpp_converter(tmp_path_factory.mktemp("llama.cpp"))
    if found is None:
        pytest.skip(f"${LLAMA_CPP_SDIST} names no llama-cpp-python sdist (the noxfile sets it)")
    return found


def made_by_llama_cpp(converter: Path, folder: Path, **kit: Any) -> tuple[Any, dict[str, Path]]:
    hf, path = tiny_qwen3_5(folder / "hf", layer_types=IRREGULAR_LAYERS, **kit)
    f32 = convert_with_llama_cpp(converter, path, folder / "F32.gguf")
    return hf, {"F32": f32, **{t: llama_quantize(f32, folder / f"{t}.gguf", t) for t in ("Q8_0", "Q4_K")}}


@pytest.fixture(scope="module", params=["dense", "moe"])
def files(request: pytest.FixtureRequest, converter: Path, tmp_path_factory: pytest.TempPathFactory) -> Files:
    moe = request.param == "moe"
    hf, gguf = made_by_llama_cpp(converter, tmp_path_factory.mktemp(request.param), moe=moe, std=STD,
                                 shared_expert_ff=SHARED_EXPERT_FF)
    return Files(moe, gguf, [reference_greedy(hf, ids, TOKENS) for ids in PROMPTS])


def serve(path: Path, backend: str) -> LLM:
    return LLM(str(path), backend=backend, dtype="float32", max_model_len=256)


def greedy_ids(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize("backend", ["torch", "cpp"])
@pytest.mark.parametrize("file_type", list(THRESHOLDS))
def test_greedy_ids_equal_llama_cpp_s_where_the_margin_is_clear(files: Files, file_type: str, backend: str) -> None:
    path, threshold = files.gguf[file_type], THRESHOLDS[file_type]
    assert {t.storage_type for t in load_checkpoint(str(path)).tensors()} == STORAGE_TYPES[file_type]
    clear = [case for reference in files.references for case in reference.clear_positions(threshold)]
    assert len(clear) >= MIN_CLEAR_POSITIONS
    llm = serve(path, backend)
    try:
        free = greedy_ids(llm, PROMPTS, TOKENS)
        forced = [ids[0] for ids in greedy_ids(llm, [ids for ids, _ in clear], 1)]
    finally:
        llm.shutdown()
    for reference, ours in zip(files.references, free, strict=True):
        reference.agreed_length(threshold, ours=ours, llama_cpp=llama_cpp_greedy(path, reference.prompt, TOKENS))
    theirs = [llama_cpp_greedy(path, ids, 1)[0] for ids, _ in clear]
    assert forced == theirs == [token for _, token in clear]


def test_q4_k_files_of_the_kit_load_and_generate(files: Files) -> None:
    """Every matrix of the kit's Q4_K file fell back (see STORAGE_TYPES); the torch backend serves the file. Its
    rounding is too coarse for this tiny model's margins, so the ids are not compared."""
    generates(files.gguf["Q4_K"], STORAGE_TYPES["Q4_K"])


def test_k_quant_blocks_load_and_generate(converter: Path, tmp_path: Path) -> None:
    """A 256-wide MoE (so also stacked experts) keeps real Q4_K and Q6_K blocks; the torch backend serves it."""
    _, wide = made_by_llama_cpp(converter, tmp_path, moe=True, hidden=256)
    generates(wide["Q4_K"], STORAGE_TYPES["Q4_K, hidden 256"])


def generates(path: Path, types: set[str]) -> None:
    checkpoint = load_checkpoint(str(path))
    assert {t.storage_type for t in checkpoint.tensors()} == types
    assert checkpoint.quantization == "Q4_K_M"
    llm = serve(path, "torch")
    try:
        assert [len(ids) for ids in greedy_ids(llm, PROMPTS, 8)] == [8] * len(PROMPTS)
    finally:
        llm.shutdown()
    assert len(llama_cpp_greedy(path, PROMPTS[0], 8)) == 8


def test_a_shared_expert_gate_stored_1_d_as_llama_cpp_writes_it_loads(tmp_path: Path, monkeypatch) -> None:
    """llama.cpp's own writer (llama-quantize) drops trailing dimensions of 1: the [1, hidden] gate of the shared
    expert comes back [hidden]. Such a file (written here without llama.cpp) loads and generates transformers' ids."""
    from pocketllm.testing import checkpoints
    from tests.torch.qwen3_5_kit import to_gguf
    from tests.torch.torch_testkit import hf_greedy

    finish = checkpoints.finish_gguf

    def squeezed(writer: Any, tensors: dict[str, tuple[Any, str]]) -> None:
        finish(writer, {name: (t.reshape(-1) if name.endswith("ffn_gate_inp_shexp.weight") else t, kind)
                        for name, (t, kind) in tensors.items()})

    monkeypatch.setattr(checkpoints, "finish_gguf", squeezed)
    hf, _ = tiny_qwen3_5(tmp_path / "hf", moe=True)
    path = to_gguf(hf, tmp_path / "model.gguf")
    checkpoint = load_checkpoint(str(path))
    gate = next(t for t in checkpoint.tensors() if t.file_name == "blk.0.ffn_gate_inp_shexp.weight")
    assert gate.shape == (1, hf.config.hidden_size)
    llm = LLM(str(path), backend="torch", dtype="float32", max_model_len=256)
    try:
        assert greedy_ids(llm, PROMPTS[1:2], 16) == [hf_greedy(hf, PROMPTS[1], 16)]
    finally:
        llm.shutdown()
