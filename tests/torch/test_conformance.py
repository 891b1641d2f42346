"""The shared conformance suite on the torch backend, in fp32 and in bf16."""

from __future__ import annotations

from typing import ClassVar

import pytest

from pocketllm.testing import BackendConformance

pytest.importorskip("pocketllm_torch")


class TestTorchConformance(BackendConformance):
    backend = "torch"
    engine_kwargs: ClassVar[dict[str, object]] = {"dtype": "float32"}


class TestTorchConformanceBF16(BackendConformance):
    backend = "torch"
    engine_kwargs: ClassVar[dict[str, object]] = {"dtype": "bfloat16"}
