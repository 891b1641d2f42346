"""Tools for testing backends: a tiny checkpoint builder and the shared conformance suite.

A backend package runs the suite with a few lines::

    from pocketllm.testing import BackendConformance

    class TestMyBackend(BackendConformance):
        backend = "mybackend"
"""

from __future__ import annotations

from pocketllm.testing.checkpoints import make_tiny_llama
from pocketllm.testing.suite import BackendConformance

__all__ = ["BackendConformance", "make_tiny_llama"]
