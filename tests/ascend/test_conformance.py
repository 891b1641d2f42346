"""The conformance kit on the Ascend backend, on the stand-in NPU, in float32 (as the torch backend runs it)."""

from __future__ import annotations

from typing import ClassVar

from pocketllm.testing import BackendConformance, ProtocolConformance, SpeculativeConformance, TensorParallelConformance

ENGINE: dict[str, object] = {"dtype": "float32", "device": "npu"}


class TestAscendConformance(BackendConformance):  # ProtocolConformance and ModelConformance
    backend = "ascend"
    engine_kwargs: ClassVar[dict[str, object]] = ENGINE


class TestAscendQwen3_5Protocol(ProtocolConformance):
    """The hybrid model's state slots and snapshots on the device, prefix caching included."""

    backend = "ascend"
    checkpoint = "qwen3_5"
    engine_kwargs: ClassVar[dict[str, object]] = ENGINE


class TestAscendTensorParallel(TensorParallelConformance):
    """TP=2: each rank on its own stand-in NPU, the collectives through the hccl backend (gloo underneath)."""

    backend = "ascend"
    engine_kwargs: ClassVar[dict[str, object]] = ENGINE


class TestAscendSpeculative(SpeculativeConformance):
    backend = "ascend"
    checkpoint = "llama-cyclic"
    engine_kwargs: ClassVar[dict[str, object]] = ENGINE
