"""Entry point of the ``pocketllm.backends`` group: registers the Ascend backend without importing torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pocketllm.hookspecs import hookimpl
from pocketllm_ascend.backend import AscendBackend

if TYPE_CHECKING:
    from collections.abc import Callable

    from pocketllm.backend import BackendPlugin


@hookimpl
def pocketllm_register_backends(register: Callable[[BackendPlugin], None]) -> None:
    register(AscendBackend())
