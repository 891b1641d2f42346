"""The shared conformance suite, run on the example third-party backend (tests/fixtures/pocketllm-echo)."""

from __future__ import annotations

from pocketllm.testing import BackendConformance


class TestEchoBackend(BackendConformance):
    backend = "echo"
