"""What the kit's backend wrappers share: another backend under a new name, registrable for one test."""

from __future__ import annotations

from typing import Any, ClassVar

from pocketllm.backend import BackendPlugin, Capabilities
from pocketllm.hookspecs import hookimpl


class BackendWrapper:
    """``inner`` as ``<inner.name>-<suffix>``, never chosen by "auto"; subclasses wrap its engines."""

    suffix: ClassVar[str]

    def __init__(self, inner: BackendPlugin) -> None:
        self.inner = inner
        self.name = f"{inner.name}-{self.suffix}"
        self.api_version = inner.api_version

    def probe(self) -> int:
        return 0  # never chosen by "auto"

    def capabilities(self) -> Capabilities:
        return self.inner.capabilities()

    def as_plugin(self) -> object:
        """An object carrying the registration hook, for ``BackendRegistry.register_plugin``."""
        backend = self

        class Plugin:
            @staticmethod
            @hookimpl
            def pocketllm_register_backends(register: Any) -> None:
                register(backend)

        return Plugin()
