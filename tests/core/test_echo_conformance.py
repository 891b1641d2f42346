"""The README's example third-party backend (tests/fixtures/pocketllm-echo) runs no model: it claims, and
passes, protocol conformance only."""

from __future__ import annotations

from pocketllm.testing import ProtocolConformance


class TestEchoProtocol(ProtocolConformance):
    backend = "echo"
