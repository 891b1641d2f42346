"""The engines a worker can load, behind one small interface; each module imports its engine lazily."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pocketbench.config import EngineSpec


@dataclass(frozen=True)
class Timing:
    """One sequence of a streamed run: seconds from its submission to its first and last token."""

    first_token_s: float
    last_token_s: float
    num_tokens: int


@dataclass(frozen=True)
class RequestTiming:
    """One request of the serve workload, in seconds from the start of its run (its first send).

    ``num_chunks``: streamed chunks that carried a choice (HTTP), or events that carried tokens (library).
    """

    sent_s: float
    first_token_s: float
    last_token_s: float
    num_tokens: int
    num_chunks: int


@dataclass(frozen=True)
class CacheStats:
    """An engine's prefix-cache counters since it loaded: prompt tokens served from the cache, and requests that
    resumed from a recurrent-state snapshot (hybrid models)."""

    prefix_cache_hits: int
    state_snapshot_hits: int


@runtime_checkable
class Engine(Protocol):
    def info(self) -> dict[str, Any]:
        """Versions and settings, for the report."""
        ...

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Greedy-decode every prompt as one batch, exactly ``max_tokens`` each (EOS ignored)."""
        ...

    def stream(self, prompts: list[list[int]], max_tokens: int) -> list[Timing]:
        """Like ``generate``, submitting every prompt at once and timing each sequence's tokens."""
        ...


@runtime_checkable
class CachingEngine(Protocol):
    """An engine with a prefix cache whose hits it counts (PocketLLM's)."""

    def cache_stats(self) -> CacheStats:
        ...


@runtime_checkable
class ServingEngine(Protocol):
    """The library side of the serve workload (``pocketllm-async``)."""

    def info(self) -> dict[str, Any]:
        ...

    def serve(self, prompts: list[list[int]], max_tokens: int) -> list[RequestTiming]:
        """Stream every prompt as its own concurrent request, exactly ``max_tokens`` each (greedy, EOS ignored)."""
        ...


def load_engine(spec: EngineSpec) -> Engine | ServingEngine:
    if spec.kind == "pocketllm":
        from pocketbench.engines.pocket import PocketEngine

        return PocketEngine(spec)
    if spec.kind == "pocketllm-async":
        from pocketbench.engines.pocket_async import AsyncPocketEngine

        return AsyncPocketEngine(spec)
    if spec.kind == "llama.cpp":
        from pocketbench.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(spec)
    if spec.kind == "transformers":
        from pocketbench.engines.hf import TransformersEngine

        return TransformersEngine(spec)
    raise ValueError(f"unknown engine kind {spec.kind!r}")
