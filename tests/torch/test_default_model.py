"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF) on the torch backend, against transformers on the same GGUF."""

from __future__ import annotations

import pytest

from pocketllm import LLM, SamplingParams
from tests.conftest import requires_default_model

pytestmark = requires_default_model
QUESTIONS = ["What is the capital of France?", "Name the planets of the solar system."]


@pytest.fixture(scope="module")
def llm():
    pytest.importorskip("pocketllm_torch")
    llm = LLM("smollm2-135m-instruct", backend="torch", dtype="float32")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def hf_model(llm: LLM):
    transformers = pytest.importorskip("transformers")
    import torch

    path = llm.checkpoint_path
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


def test_chat_is_coherent_english(llm: LLM) -> None:
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                    SamplingParams(temperature=0.0, max_tokens=48))
    assert "Paris" in outs[0].outputs[0].text
    assert any(p in outs[1].outputs[0].text for p in ("Mercury", "Venus", "Earth", "Mars", "Jupiter"))


def test_greedy_ids_equal_transformers_on_the_same_gguf(llm: LLM, hf_model) -> None:
    import torch

    for question in ("Explain why the sky is blue.", "Name the planets of the solar system."):
        [out] = llm.chat([{"role": "user", "content": question}], SamplingParams(temperature=0.0, max_tokens=32))
        prompt = torch.tensor([out.prompt_token_ids])
        with torch.inference_mode():
            ref = hf_model.generate(prompt, max_new_tokens=32, do_sample=False, attention_mask=torch.ones_like(prompt))
        assert len(out.outputs[0].token_ids) >= 16
        assert out.outputs[0].token_ids == ref[0, prompt.shape[1]:].tolist()


def test_default_dtype_keeps_q4_matrices_4bit_and_stays_coherent() -> None:
    pytest.importorskip("pocketllm_torch")
    from pocketllm_torch.linear import GroupedLinear, uses_int4

    llm = LLM("smollm2-135m-instruct", backend="torch")  # dtype auto: bf16 on AVX2/AVX-512 CPUs
    try:
        [out] = llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0.0, max_tokens=24))
        engine = llm.backend_engine
        if uses_int4(engine.config.device, engine.config.dtype):
            assert isinstance(engine.runner.model.layers[0].attn.qkv_proj, GroupedLinear)
        assert "Paris" in out.outputs[0].text
    finally:
        llm.shutdown()
