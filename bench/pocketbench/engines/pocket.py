"""A PocketLLM backend through the public ``LLM`` API."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pocketllm
from pocketbench.config import EngineSpec
from pocketbench.engines import CacheStats, Timing
from pocketllm import LLM, SamplingParams, StreamEvent
from pocketllm.plugins import BackendRegistry

THREADS_OPTION = "num_threads"


@dataclass(frozen=True)
class BackendSetup:
    """What LLM and AsyncLLM (and, through the serve workload, pocketllm-server) are built with."""

    registry: BackendRegistry
    version: str  # the backend's distribution and version
    options: dict[str, Any]  # backend_options

    @classmethod
    def of(cls, spec: EngineSpec) -> BackendSetup:
        assert spec.backend is not None
        registry = BackendRegistry(allow={spec.backend})
        plugin = registry.get(spec.backend)
        entry = next(e for e in registry.entries() if e.name == spec.backend)
        # Backends without a thread option follow OMP_NUM_THREADS, which the harness sets for every worker.
        # (A BackendOptions class since contract 3; a --baseline version may still declare a tuple of names.)
        declared = getattr(plugin.capabilities().backend_options, "__struct_fields__", None) or \
            plugin.capabilities().backend_options
        options = {THREADS_OPTION: spec.threads} if THREADS_OPTION in declared else {}
        return cls(registry, f"{entry.distribution} {entry.version}", options)

    def engine_kwargs(self, spec: EngineSpec) -> dict[str, Any]:
        return {"backend": spec.backend, "dtype": spec.dtype, "max_model_len": spec.max_len,
                "max_num_seqs": spec.max_seqs, "enable_prefix_caching": spec.prefix_caching,
                "backend_options": self.options, "registry": self.registry}

    def info(self, spec: EngineSpec) -> dict[str, Any]:
        return {"engine": f"PocketLLM {pocketllm.__version__}, backend {self.version}", "dtype": spec.dtype,
                "threads": spec.threads,
                "threads_set_by": "backend_options.num_threads" if self.options else "OMP_NUM_THREADS"}


class PocketEngine:
    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.setup = BackendSetup.of(spec)
        self.llm = LLM(spec.model, **self.setup.engine_kwargs(spec))

    def info(self) -> dict[str, Any]:
        return self.setup.info(self.spec)

    def cache_stats(self) -> CacheStats:
        stats = self.llm.stats()
        return CacheStats(stats.num_prefix_cache_hits, stats.num_state_snapshot_hits)

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        outputs = self.llm.generate(prompts, greedy_params(max_tokens))
        return [out.outputs[0].token_ids for out in outputs]

    def stream(self, prompts: list[list[int]], max_tokens: int) -> list[Timing]:
        params = greedy_params(max_tokens)
        streams: list[tuple[float, Iterator[StreamEvent]]] = []
        for prompt in prompts:  # each call submits its request before returning
            streams.append((time.perf_counter(), self.llm.generate_stream(prompt, params)))
        timings: list[Timing | None] = [None] * len(prompts)

        def consume(i: int, submitted: float, events: Iterator[StreamEvent]) -> None:
            first = last = 0.0
            count = 0
            for event in events:
                if event.token_ids:
                    last = time.perf_counter() - submitted
                    first = first or last
                    count += len(event.token_ids)
            timings[i] = Timing(first, last, count)

        threads = [threading.Thread(target=consume, args=(i, *s)) for i, s in enumerate(streams)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(t is None for t in timings):
            raise RuntimeError("a stream ended with an error (see the worker log)")
        return [t for t in timings if t is not None]


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
