"""pytest plugin (entry point ``pytest11``): fixtures shared by every backend's conformance run."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def pocketllm_tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama checkpoint directory with a byte-level BPE tokenizer."""
    from pocketllm.testing.checkpoints import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("pocketllm-tiny-llama"))
