"""Entry point of the ``pocketllm.backends`` group: registers the cpp backend (cheap: no model, no threads)."""

from __future__ import annotations

from pocketllm import hookimpl
from pocketllm_cpp.backend import CppBackend


@hookimpl
def pocketllm_register_backends(register):  # type: ignore[no-untyped-def]
    register(CppBackend())
