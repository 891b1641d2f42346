"""The timed workloads: what each engine is asked to do and which figures its reply yields."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pocketbench.config import Sizes
from pocketbench.prompts import PromptSet
from pocketbench.stats import percentile


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    unit: str
    higher_is_better: bool


@dataclass(frozen=True)
class Measurement:
    """One worker request, repeated per run, and how to read figures from its reply."""

    key: str
    op: str  # "generate" or "stream" (every engine), or "serve" (the library and HTTP targets of the serve workload)
    prompts: list[list[int]]
    max_tokens: int
    figures: tuple[Figure, ...]
    extract: Callable[[dict[str, Any]], list[float]]  # one value per figure

    def values(self, reply: dict[str, Any]) -> dict[str, float]:
        counts = [len(ids) for ids in reply["token_ids"]] if self.op == "generate" else [
            t["num_tokens"] for t in reply["timings"]]
        if counts != [self.max_tokens] * len(self.prompts):
            raise RuntimeError(f"{self.key}: expected {self.max_tokens} tokens per sequence, got {counts}")
        return {f.key: v for f, v in zip(self.figures, self.extract(reply), strict=True)}


RSS = Figure("peak_rss_mb", "peak RSS", "MB", higher_is_better=False)


def prefill(sizes: Sizes, prompts: PromptSet) -> Measurement:
    n = sizes.prefill_tokens
    return Measurement("prefill", "generate", [prompts.prefill], 1,
                       (Figure("prefill_tok_s", f"prefill, {n}-token prompt", "tok/s", True),),
                       lambda r: [n / r["seconds"]])


def decode(sizes: Sizes, prompts: PromptSet) -> Measurement:
    def extract(reply: dict[str, Any]) -> list[float]:
        t = reply["timings"][0]
        return [(t["num_tokens"] - 1) / (t["last_token_s"] - t["first_token_s"])]

    return Measurement("decode", "stream", prompts.prompts[:1], sizes.new_tokens,
                       (Figure("decode_tok_s", f"decode, single stream, {sizes.new_tokens} tokens", "tok/s", True),),
                       extract)


def batch(n: int, sizes: Sizes, prompts: PromptSet) -> Measurement:
    """N prompts at once, streamed: end-to-end (prefill included) and decode-only aggregates, apart.

    Decode-only counts the tokens after each sequence's first, over the time from the moment every sequence
    has its first token to the last token of any: batched prefill, slow on some engines, does not weigh in.
    """
    what = f"{n} x ({sizes.prompt_tokens} in + {sizes.new_tokens} out)"

    def extract(reply: dict[str, Any]) -> list[float]:
        timings = reply["timings"]
        decoded = sum(t["num_tokens"] - 1 for t in timings)
        span = max(t["last_token_s"] for t in timings) - max(t["first_token_s"] for t in timings)
        return [n * sizes.new_tokens / reply["seconds"], decoded / max(span, 1e-9)]

    return Measurement(f"batch{n}", "stream", prompts.prompts[:n], sizes.new_tokens,
                       (Figure(f"batch{n}_tok_s", f"aggregate end to end, {what}", "tok/s", True),
                        Figure(f"batch{n}_decode_tok_s", f"aggregate decode only, {what}", "tok/s", True)),
                       extract)


def ttft(sizes: Sizes, prompts: PromptSet) -> Measurement:
    label = f"TTFT {{}}, {sizes.ttft_requests} concurrent {sizes.prompt_tokens}-token requests"
    return Measurement("ttft", "stream", prompts.prompts[:sizes.ttft_requests], sizes.ttft_new_tokens,
                       (Figure("ttft_p50_ms", label.format("p50"), "ms", False),
                        Figure("ttft_p99_ms", label.format("p99"), "ms", False)),
                       lambda r: [1000 * percentile([t["first_token_s"] for t in r["timings"]], q) for q in (50, 99)])


def serve_values(timings: list[dict[str, Any]]) -> list[float]:
    """Aggregate tok/s (every streamed token / (last token of any - first send)), then TTFT p50 and p99 in ms."""
    span = max(t["last_token_s"] for t in timings) - min(t["sent_s"] for t in timings)
    ttfts = [t["first_token_s"] - t["sent_s"] for t in timings]
    return [sum(t["num_tokens"] for t in timings) / span, *(1000 * percentile(ttfts, q) for q in (50, 99))]


def serve(n: int, sizes: Sizes, prompts: PromptSet) -> Measurement:
    clients = f"{n} streaming client{'s' if n > 1 else ''}"
    what = f"serve, {clients} x ({sizes.prompt_tokens} in + {sizes.new_tokens} out)"
    return Measurement(f"serve{n}", "serve", prompts.prompts[:n], sizes.new_tokens,
                       (Figure(f"serve{n}_tok_s", f"{what}, aggregate", "tok/s", True),
                        Figure(f"serve{n}_ttft_p50_ms", f"{what}, TTFT p50", "ms", False),
                        Figure(f"serve{n}_ttft_p99_ms", f"{what}, TTFT p99", "ms", False)),
                       lambda r: serve_values(r["timings"]))


def plan(workloads: tuple[str, ...], sizes: Sizes, prompts: PromptSet) -> list[Measurement]:
    """The measurements of the selected workloads, in report order."""
    plans: list[Measurement] = []
    if "prefill" in workloads:
        plans.append(prefill(sizes, prompts))
    if "decode" in workloads:
        plans.append(decode(sizes, prompts))
    if "batch" in workloads:
        plans.extend(batch(n, sizes, prompts) for n in sizes.concurrency)
    if "ttft" in workloads:
        plans.append(ttft(sizes, prompts))
    if "serve" in workloads:
        plans.extend(serve(n, sizes, prompts) for n in sizes.serve_concurrency)
    return plans
