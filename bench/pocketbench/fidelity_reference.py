"""llama.cpp's greedy answers to the fidelity questions on the default model, saved for the test suite.

The suite cannot build llama.cpp (minutes of compiling), so ``tests/cpp/test_default_model.py`` compares the cpp
backend with ids recorded here once, together with llama.cpp's top-2 logit margin at each step (a margin near 0
would let two correct engines disagree). Regenerate with::

    python -m pocketbench.fidelity_reference tests/cpp/data/default_model_llamacpp.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import llama_cpp
import numpy as np

from pocketbench.prompts import build_prompts
from pocketllm.args import DEFAULT_MODEL
from pocketllm.checkpoint import load_checkpoint
from pocketllm.checkpoint.resolve import resolve_path

TOKENS = 32


def greedy_with_margins(llm: llama_cpp.Llama, prompt: list[int], tokens: int) -> tuple[list[int], list[float]]:
    llm.reset()
    llm.eval(prompt)
    ids, margins = [], []
    for _ in range(tokens):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        second, first = np.sort(logits)[-2:]
        ids.append(int(np.argmax(logits)))
        margins.append(float(first - second))
        llm.eval([ids[-1]])
    return ids, margins


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    path = str(resolve_path(DEFAULT_MODEL))
    prompts = build_prompts(load_checkpoint(path), prefill_tokens=1, prompt_tokens=1, count=1, fidelity_prompts=3)
    llm = llama_cpp.Llama(path, n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    cases = []
    for question, ids in prompts.fidelity:
        tokens, margins = greedy_with_margins(llm, ids, TOKENS)
        cases.append({"question": question, "prompt_ids": ids, "token_ids": tokens,
                      "min_margin": round(min(margins), 4)})
    report = {"engine": f"llama-cpp-python {llama_cpp.__version__}", "model": Path(path).name, "cases": cases}
    parser.parse_args().out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
