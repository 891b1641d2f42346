"""Entry point of the ``pocketllm.backends`` group: registers the torch backend without importing torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pocketllm.hookspecs import hookimpl
from pocketllm_torch.backend import TorchBackend

if TYPE_CHECKING:
    from collections.abc import Callable

    from pocketllm.backend import BackendPlugin


@hookimpl
def pocketllm_register_backends(register: Callable[[BackendPlugin], None]) -> None:
    register(TorchBackend())
