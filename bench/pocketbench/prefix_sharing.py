"""The shared-prefix workload on the engines' worker processes: N requests at once, each a shared prompt prefix
(seen once before, by a request of its own) plus its own question; runs interleaved engine by engine.

Figures per engine: TTFT p50 and p99 (submission -> first token), aggregate tok/s (every generated token / wall time
of the run), and for PocketLLM (prefix caching on) the hit rate: prompt tokens served from its cache / shared-prefix
tokens of the N requests. The questions are new in every run, so that only the prefix can hit. llama.cpp's C API
shares no cache across sequences (its server's per-slot cache would not serve N fresh slots either): each of its
requests prefills its whole prompt, and it has no hit rate.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from pocketbench.config import EngineSpec
from pocketbench.results import BenchResults
from pocketbench.stats import percentile
from pocketbench.workers import Worker
from pocketbench.workloads import Figure

KEY = "shared_prefix"


@dataclass(frozen=True)
class PrefixSizes:
    requests: int = 32
    prefix_tokens: int = 2048
    question_tokens: int = 64
    new_tokens: int = 32

    @property
    def max_len(self) -> int:
        return -(-(self.prefix_tokens + self.question_tokens + self.new_tokens) // 256) * 256

    def figures(self) -> tuple[Figure, ...]:
        what = (f"shared prefix, {self.requests} x ({self.prefix_tokens} shared + {self.question_tokens} own in + "
                f"{self.new_tokens} out)")
        return (Figure("shared_ttft_p50_ms", f"{what}, TTFT p50", "ms", False),
                Figure("shared_ttft_p99_ms", f"{what}, TTFT p99", "ms", False),
                Figure("shared_tok_s", f"{what}, aggregate end to end", "tok/s", True),
                Figure("shared_hit_rate", f"{what}, prefix-cache hits / shared tokens", "fraction", True),
                Figure("shared_peak_rss_mb", "peak RSS of the shared-prefix workers", "MB", False))


def specs_for(engines: list[EngineSpec], sizes: PrefixSizes) -> list[EngineSpec]:
    """The engines again, sized for the workload, PocketLLM's with prefix caching on."""
    return [dataclasses.replace(spec, max_seqs=sizes.requests, max_len=sizes.max_len,
                                prefix_caching=spec.kind == "pocketllm") for spec in engines]


def run(specs: list[EngineSpec], sizes: PrefixSizes, *, runs: int, warmup: int, token_range: int, log_dir: Path,
        results: BenchResults) -> None:
    """Measure every engine of ``specs`` (prompt token ids drawn below ``token_range``) into ``results``."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, token_range, sizes.prefix_tokens).tolist()
    figures = sizes.figures()
    results.figures.extend(figures)
    with contextlib.ExitStack() as stack:
        workers = []
        for spec in tqdm(specs, desc="loading shared-prefix engines", unit="engine"):
            workers.append(Worker(spec, log_dir))
            stack.callback(workers[-1].close)
        for worker in workers:
            worker.call("stream", prompts=[[*prefix, 5]], max_tokens=1)  # the prefix, seen once before
        with tqdm(total=(warmup + runs) * len(workers), desc="shared prefix", unit="run") as bar:
            for i in range(warmup + runs):
                prompts = [prefix + rng.integers(3, token_range, sizes.question_tokens).tolist()
                           for _ in range(sizes.requests)]
                for worker in workers:
                    before = _hits(worker)
                    reply = worker.call("stream", prompts=prompts, max_tokens=sizes.new_tokens)
                    after = _hits(worker)
                    values = _values(reply, sizes, figures)
                    if before is not None and after is not None:
                        values[figures[3].key] = (after - before) / (sizes.prefix_tokens * sizes.requests)
                    if i >= warmup:
                        results.record(KEY, worker.label, reply, values)
                    bar.update()
        for worker in workers:
            results.values.setdefault(figures[4].key, {})[worker.label] = [worker.call("rss")["peak_rss_mb"]]


def _hits(worker: Worker) -> int | None:
    return worker.call("cache_stats")["prefix_cache_hits"] if worker.spec.kind == "pocketllm" else None


def _values(reply: dict[str, Any], sizes: PrefixSizes, figures: tuple[Figure, ...]) -> dict[str, float]:
    timings = reply["timings"]
    counts = [t["num_tokens"] for t in timings]
    if counts != [sizes.new_tokens] * sizes.requests:
        raise RuntimeError(f"{KEY}: expected {sizes.new_tokens} tokens per request, got {counts}")
    ttfts = [1000 * t["first_token_s"] for t in timings]
    return {figures[0].key: percentile(ttfts, 50), figures[1].key: percentile(ttfts, 99),
            figures[2].key: sum(counts) / reply["seconds"]}
