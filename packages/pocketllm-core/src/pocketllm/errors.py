"""Typed errors raised by PocketLLM. Every error names what was wrong."""

from __future__ import annotations


class PocketLLMError(Exception):
    """Base class of every error PocketLLM raises on purpose."""


class ConfigError(PocketLLMError, ValueError):
    """A field of EngineArgs or SamplingParams has a bad value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class UnsupportedOptionError(PocketLLMError, ValueError):
    """The selected backend does not support an option that was asked for."""

    def __init__(self, option: str, backend: str, detail: str = "") -> None:
        msg = f"option {option!r} is not supported by backend {backend!r}"
        super().__init__(f"{msg}: {detail}" if detail else msg)
        self.option = option
        self.backend = backend


class BackendNotFoundError(PocketLLMError, LookupError):
    """No registered backend matches the name asked for, or none is available."""


class BrokenBackendError(BackendNotFoundError):
    """A registered backend failed when the core called it (its ``capabilities()`` raised, say): the message names
    the backend, its distribution and the contract version it declared."""

    def __init__(self, message: str, backend: str, distribution: str) -> None:
        super().__init__(message)
        self.backend = backend
        self.distribution = distribution


class CheckpointError(PocketLLMError, ValueError):
    """A checkpoint could not be found, parsed, or is corrupt."""


class PromptTooLongError(PocketLLMError, ValueError):
    """A prompt (plus max_tokens) does not fit in max_model_len."""


class EngineDeadError(PocketLLMError, RuntimeError):
    """The engine loop stopped because the backend raised; no request can run."""


class RequestFailedError(PocketLLMError, RuntimeError):
    """The engine failed this one request while running it; other requests were not affected."""


class GrammarError(ConfigError, RequestFailedError):
    """The engine failed a request because its grammar, with its other parameters, left no token to sample
    (``field`` is ``structured_outputs`` or ``min_tokens``): the request's own doing, and it failed alone."""


class OverloadedError(PocketLLMError, RuntimeError):
    """The engine cannot take this request now (its grammar compiles are all taken, say); it may later."""


class RequestCancelledError(PocketLLMError, RuntimeError):
    """A request that has no partial result (an embedding) was aborted, or the engine shut down, before it ended."""
