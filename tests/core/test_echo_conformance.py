"""The plugin guide's example third-party backend (tests/fixtures/pocketllm-echo) runs no model: it claims, and
passes, protocol conformance only, with one token per step and with several."""

from __future__ import annotations

from typing import Any, ClassVar

from pocketllm.testing import MultiTokenConformance, ProtocolConformance


class TestEchoProtocol(ProtocolConformance):
    backend = "echo"


class TestEchoSeveralTokensPerStep(ProtocolConformance):
    """The whole protocol again, with steps that give each request three tokens."""

    backend = "echo"
    engine_kwargs: ClassVar[dict[str, Any]] = {"backend_options": {"tokens_per_step": 3}}


class TestEchoSteps(MultiTokenConformance):
    backend = "echo"
    multi_token_kwargs: ClassVar[dict[str, Any]] = {"backend_options": {"tokens_per_step": 4}}
