"""lm-evaluation-harness's `local-completions` model against a real server, on a multiple-choice task defined in a
local YAML file with local data (nothing is downloaded): it tokenizes through the server (/tokenizer_info,
/tokenize) and scores with /v1/completions' echo and logprobs. Its loglikelihoods equal the library's prompt
logprobs of the same tokens."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest

from pocketllm import AsyncLLM, SamplingParams
from tests.server.conftest import LiveServer

lm_eval = pytest.importorskip("lm_eval")

DOCS = [{"question": "The cat sat on the", "choices": ["mat", "moon", "sea"], "answer": 0},
        {"question": "One, two, three,", "choices": ["four", "blue"], "answer": 0},
        {"question": "Paris is the capital of", "choices": ["France", "cheese", "the sea", "seven"], "answer": 0}]
TASK = """task: pocketllm_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def loglikelihood(llm: AsyncLLM, context: str, continuation: str) -> float:
    """The continuation's logprob given the context, from the library's prompt logprobs, tokenized as lm-eval
    tokenizes a pair (the context's trailing spaces go with the continuation)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = llm.tokenizer.encode(context + continuation, add_special_tokens=False)
    start = len(llm.tokenizer.encode(context, add_special_tokens=False))
    out = asyncio.run(llm.complete(whole, SamplingParams(max_tokens=0, prompt_logprobs=0)))
    return sum(entry.logprob for entry in out.prompt_logprobs[start:])


def test_multiple_choice_loglikelihoods_equal_the_library_s(torch_server: LiveServer, torch_llm: AsyncLLM,
                                                              tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "pocketllm_mc.yaml").write_text(TASK.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": "tiny", "base_url": f"{torch_server.url}/v1/completions", "num_concurrent": 1,
                    "max_retries": 1},
        tasks=["pocketllm_mc"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    samples = results["samples"]["pocketllm_mc"]
    assert len(samples) == len(DOCS)
    for sample in samples:
        for (context, continuation), (score, _greedy) in zip(sample["arguments"], sample["filtered_resps"],
                                                             strict=True):
            assert math.isclose(score, loglikelihood(torch_llm, context, continuation), abs_tol=1e-4)
    assert 0.0 <= results["results"]["pocketllm_mc"]["acc,none"] <= 1.0
