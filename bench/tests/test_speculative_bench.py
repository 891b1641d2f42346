"""The speculative-decoding bench's own parts on the kit's cyclic Llama (no llama-server here): PocketLLM's decode
and batch figures, and that the engines it measures leave the environment its peers inherit as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pocketbench.speculative import pocket_batch, pocket_decode
from pocketllm import LLM

pytest.importorskip("pocketllm_cpp._native")


def test_pocket_figures_and_a_clean_environment_for_the_peers(pocketllm_kit_checkpoint) -> None:
    before = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    path: Path = pocketllm_kit_checkpoint("llama-cyclic")
    engines = [LLM(str(path), backend=backend, speculative_method="ngram", num_speculative_tokens=4)
               for backend in ("cpp", "torch")]
    try:
        for llm in engines:
            speed, tokens = pocket_decode(llm, [5, 6, 7, 8], 40)
            assert speed > 0 and len(tokens) == 40
            assert pocket_batch(llm, [[5, 6, 7], [9, 10]], 20) > 0
        # llama.cpp's OpenMP, told to sleep between its regions by a variable the torch backend left behind,
        # decoded at half its speed: the engines' choices are their own, not their children's.
        assert {k: os.environ.get(k) for k in before} == before
    finally:
        for llm in engines:
            llm.shutdown()
