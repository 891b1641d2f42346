"""What one bench run measures: sizes, engines, repetitions and where results go."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PEERS = ("llama.cpp", "transformers")
WORKLOADS = ("startup", "prefill", "decode", "batch", "ttft", "serve", "fidelity")
KNOWN_BACKENDS = ("torch", "cpp")  # PocketLLM backends measured by default, where installed
# The serve workload's goal: aggregate tok/s over HTTP at least this fraction of the library's, at these clients.
SERVE_TARGET_RATIO = 0.9
SERVE_TARGET_CLIENTS = 16
BASELINE_SUFFIX = "@baseline"


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """Token counts of the workloads (see ``pocketllm bench --help``)."""

    prefill_tokens: int = 512
    prompt_tokens: int = 128
    new_tokens: int = 128
    concurrency: tuple[int, ...] = (1, 4, 8, 16)
    ttft_requests: int = 8
    ttft_new_tokens: int = 32
    serve_concurrency: tuple[int, ...] = (1, 8, 16)  # clients of the serve workload (HTTP against AsyncLLM)
    fidelity_prompts: int = 3
    fidelity_tokens: int = 32

    @property
    def max_seqs(self) -> int:
        return max(*self.concurrency, self.ttft_requests, *self.serve_concurrency, 1)

    @property
    def max_len(self) -> int:
        """Positions one sequence may need, rounded up so every engine gets the same roomy context."""
        longest = max(self.prefill_tokens + 1, self.prompt_tokens + self.new_tokens, 1024)
        return -(-longest // 256) * 256


FULL = Sizes()
QUICK = Sizes(prefill_tokens=128, prompt_tokens=32, new_tokens=16, concurrency=(1, 4), ttft_requests=4,
              ttft_new_tokens=4, serve_concurrency=(1, 2), fidelity_prompts=1, fidelity_tokens=8)


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    """How a worker process loads one engine; travels to the worker as JSON."""

    kind: str  # "pocketllm" | "pocketllm-async" (AsyncLLM, serve workload) | "llama.cpp" | "transformers"
    model: str  # a PocketLLM model string (alias, .gguf path or directory)
    model_path: str  # the resolved file or directory, for the peers
    threads: int
    max_seqs: int
    max_len: int
    backend: str | None = None  # PocketLLM only
    dtype: str = "auto"  # PocketLLM only
    prefix_caching: bool = False  # PocketLLM only: enable_prefix_caching (the Qwen3.5 shared-prefix workload)
    source: str | None = None  # --baseline: the directory whose PocketLLM packages this engine imports first

    @property
    def label(self) -> str:
        return self.kind_label + (BASELINE_SUFFIX if self.source else "")

    @property
    def kind_label(self) -> str:
        if self.kind == "pocketllm":
            return f"pocketllm-{self.backend}"
        if self.kind == "pocketllm-async":
            return f"pocketllm-{self.backend}-async"
        return self.kind

    def python_path(self, *first: str) -> str:
        """The engine process's PYTHONPATH: ``first``, then the baseline's packages, then ours."""
        return os.pathsep.join(filter(None, [*first, self.source, os.environ.get("PYTHONPATH")]))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineSpec:
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    model: str
    backends: tuple[str, ...]
    peers: tuple[str, ...]
    dtype: str
    threads: int
    runs: int
    warmup: int
    workloads: tuple[str, ...]
    sizes: Sizes
    quick: bool
    out_dir: Path
    machine: str
    baseline: Path | None = None  # another PocketLLM version's packages, each of its engines run beside ours
