"""The conformance kit on the cpp backend: the protocol, and transformers' outputs on the kit's checkpoints.

ModelConformance runs with exact_activations and a float32 KV cache: the kit's references are float32 arithmetic
over the stored blocks, which 8-bit activations and half-precision keys and values (the defaults, llama.cpp's way)
only approximate on its random weights."""

from __future__ import annotations

from typing import ClassVar

import pytest

from pocketllm.testing import ModelConformance, ProtocolConformance, SpeculativeConformance

pytest.importorskip("pocketllm_cpp._native")


class TestCppProtocol(ProtocolConformance):
    backend = "cpp"


class TestCppModels(ModelConformance):
    backend = "cpp"
    engine_kwargs: ClassVar[dict[str, object]] = {"backend_options": {"exact_activations": True},
                                                  "kv_cache_dtype": "float32"}


class TestCppQwen3_5Protocol(ProtocolConformance):
    """The protocol checks on the kit's hybrid Qwen3.5 (Gated DeltaNet state slots and snapshots beside the KV
    cache), prefix caching included."""

    backend = "cpp"
    checkpoint = "qwen3_5"
    engine_kwargs: ClassVar[dict[str, object]] = {"backend_options": {"exact_activations": True},
                                                  "kv_cache_dtype": "float32"}


class TestCppSpeculativeLlama(SpeculativeConformance):
    """ngram drafts verified as one slice per sequence, in the engine's default arithmetic (8-bit activations, a
    half-precision KV cache): a row's bits do not depend on the rows beside it."""

    backend = "cpp"
    checkpoint = "llama-cyclic"


class TestCppSpeculativeQwen3(SpeculativeConformance):
    backend = "cpp"
    checkpoint = "qwen3-cyclic"
    multi_token_kwargs: ClassVar[dict[str, object]] = {"speculative_method": "ngram", "num_speculative_tokens": 2,
                                                       "ngram_min": 2, "ngram_max": 3}


class TestCppSpeculativeQwen3_5(SpeculativeConformance):
    """The hybrid: the Gated DeltaNet state after each verified row is captured, and the accepted one loaded."""

    backend = "cpp"
    checkpoint = "qwen3_5-cyclic"


class TestCppSpeculativeQwen3_5MTP(SpeculativeConformance):
    """Drafts from the checkpoint's multi-token-prediction head, its layer's keys and values in the paged cache."""

    backend = "cpp"
    checkpoint = "qwen3_5-cyclic-mtp"
    multi_token_kwargs: ClassVar[dict[str, object]] = {"speculative_method": "mtp", "num_speculative_tokens": 3}
