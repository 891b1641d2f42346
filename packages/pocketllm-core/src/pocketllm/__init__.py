"""PocketLLM: a small, fast LLM inference engine with pluggable backends.

``import pocketllm`` is cheap and never imports torch or a backend.
"""

from __future__ import annotations

from pocketllm.args import EngineArgs
from pocketllm.backend import API_VERSION, BackendStats, Capabilities, RequestDelta, SampledLogprobs, TokenLogprob
from pocketllm.backend_options import BackendOptions
from pocketllm.errors import (
    BackendNotFoundError,
    BrokenBackendError,
    CheckpointError,
    ConfigError,
    EngineDeadError,
    GrammarError,
    OverloadedError,
    PocketLLMError,
    PromptTooLongError,
    RequestCancelledError,
    RequestFailedError,
    UnsupportedOptionError,
)
from pocketllm.hookspecs import hookimpl
from pocketllm.outputs import CompletionOutput, RequestOutput, StreamEvent, Usage
from pocketllm.pooling import EmbeddingOutput, PoolingParams
from pocketllm.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # LLM pulls in the tokenizer and checkpoint readers; load them on first use only.
    if name == "LLM":
        from pocketllm.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from pocketllm.async_llm import AsyncLLM
        return AsyncLLM
    raise AttributeError(f"module 'pocketllm' has no attribute {name!r}")


__all__ = [
    "API_VERSION", "AsyncLLM", "BackendNotFoundError", "BackendOptions", "BackendStats", "BrokenBackendError",
    "Capabilities", "CheckpointError",
    "CompletionOutput", "ConfigError", "EmbeddingOutput", "EngineArgs", "EngineDeadError", "GrammarError", "LLM",
    "OverloadedError", "PocketLLMError",
    "PoolingParams", "PromptTooLongError", "RequestCancelledError", "RequestDelta", "RequestFailedError",
    "RequestOutput", "SampledLogprobs", "SamplingParams", "StreamEvent", "TokenLogprob", "UnsupportedOptionError",
    "Usage", "hookimpl",
]
