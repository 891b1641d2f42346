"""pytest plugin (entry point ``pytest11``): fixtures shared by every backend's conformance run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def pocketllm_kit_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``get(kind)``: the path of a kit checkpoint (see ``checkpoints.KIT_CHECKPOINTS``), written once a session."""
    from pocketllm.testing.checkpoints import write_checkpoint

    written: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in written:
            written[kind] = write_checkpoint(kind, tmp_path_factory.mktemp(f"pocketllm-kit-{kind}"))
        return written[kind]

    return get


@pytest.fixture(scope="session")
def pocketllm_tiny_llama(pocketllm_kit_checkpoint: Callable[[str], Path]) -> Path:
    """The kit's tiny random-weight Llama checkpoint directory, with a byte-level BPE tokenizer."""
    return pocketllm_kit_checkpoint("llama")
