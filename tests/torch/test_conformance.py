"""The conformance kit on the torch backend, in float32: the configuration whose results do not depend on what
else is in the batch, which the kit's batch-against-alone checks need (bf16 kernels vary with the row count)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from pocketllm.testing import BackendConformance, ProtocolConformance, TensorParallelConformance

pytest.importorskip("pocketllm_torch")


class TestTorchConformance(BackendConformance):  # ProtocolConformance and ModelConformance
    backend = "torch"
    engine_kwargs: ClassVar[dict[str, object]] = {"dtype": "float32"}


class TestTorchQwen3_5Protocol(ProtocolConformance):
    """The protocol checks on the kit's hybrid Qwen3.5 (Gated DeltaNet state slots and snapshots beside the KV
    cache), prefix caching included."""

    backend = "torch"
    checkpoint = "qwen3_5"
    engine_kwargs: ClassVar[dict[str, object]] = {"dtype": "float32"}


class TestTorchTensorParallel(TensorParallelConformance):
    """TP=2 over gloo, the ranks started by the library."""

    backend = "torch"
    engine_kwargs: ClassVar[dict[str, object]] = {"dtype": "float32"}
