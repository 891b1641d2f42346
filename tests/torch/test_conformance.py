"""The conformance kit on the torch backend, in float32: the configuration whose results do not depend on what
else is in the batch, which the kit's batch-against-alone checks need (bf16 kernels vary with the row count)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from pocketllm.testing import BackendConformance, ProtocolConformance, SpeculativeConformance, TensorParallelConformance

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


class TestTorchSpeculativeLlama(SpeculativeConformance):
    """ngram drafts verified in one step per sequence, over the paged KV cache."""

    backend = "torch"
    checkpoint = "llama-cyclic"
    engine_kwargs: ClassVar[dict[str, object]] = {"dtype": "float32"}


class TestTorchSpeculativeQwen3(SpeculativeConformance):
    backend = "torch"
    checkpoint = "qwen3-cyclic"
    engine_kwargs: ClassVar[dict[str, object]] = {"dtype": "float32"}
    multi_token_kwargs: ClassVar[dict[str, object]] = {"speculative_method": "ngram", "num_speculative_tokens": 2,
                                                       "ngram_min": 2, "ngram_max": 3}


class TestTorchSpeculativeQwen3_5(SpeculativeConformance):
    """The hybrid: Gated DeltaNet states keep a state per verified row and commit the accepted one."""

    backend = "torch"
    checkpoint = "qwen3_5-cyclic"
    engine_kwargs: ClassVar[dict[str, object]] = {"dtype": "float32"}


class TestTorchSpeculativeQwen3_5MTP(SpeculativeConformance):
    """Drafts from the checkpoint's multi-token-prediction head, its own layer's keys and values in the KV cache."""

    backend = "torch"
    checkpoint = "qwen3_5-cyclic-mtp"
    engine_kwargs: ClassVar[dict[str, object]] = {"dtype": "float32"}
    multi_token_kwargs: ClassVar[dict[str, object]] = {"speculative_method": "mtp", "num_speculative_tokens": 3}
