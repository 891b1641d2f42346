"""Engine benchmark on the default model: prefill, single-stream decode, batch-8 aggregate, peak RSS.

    python bench/bench_engine.py [--backend torch] [--dtype bfloat16] [--runs 3] [--json out.json]

Prints a table and writes JSON. Figures are medians of ``--runs`` measured runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import time
from pathlib import Path

from pocketllm import LLM, SamplingParams

PROMPT_WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wise",
                "owls", "watch", "from", "an", "old", "oak", "tree", "and", "count", "the", "stars", "one", "by",
                "one", "until", "the", "morning", "light", "arrives"]


def make_prompt(llm: LLM, num_tokens: int, salt: int = 0) -> list[int]:
    words = [PROMPT_WORDS[(i * 7 + salt) % len(PROMPT_WORDS)] for i in range(num_tokens * 2)]
    return llm.tokenizer.encode(" ".join(words))[:num_tokens]


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(runs: int, fn) -> list[float]:
    fn()  # warm-up
    return [timed(fn) for _ in range(runs)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    ns = parser.parse_args()

    start = time.perf_counter()
    llm = LLM(ns.model, backend=ns.backend, dtype=ns.dtype, max_model_len=2048)
    load_s = time.perf_counter() - start
    prefill_prompt = make_prompt(llm, 512)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    decode = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    batch_prompts = [make_prompt(llm, 128, salt=i) for i in range(8)]

    prefill = measure(ns.runs, lambda: llm.generate(prefill_prompt, one))
    single = measure(ns.runs, lambda: llm.generate(make_prompt(llm, 16), decode))
    batch8 = measure(ns.runs, lambda: llm.generate(batch_prompts, decode))
    llm.shutdown()

    figures = {
        "load_s": load_s,
        "prefill_tok_s": 512 / statistics.median(prefill),
        "decode_tok_s": 128 / statistics.median(single),  # includes a 16-token prefill
        "batch8_aggregate_tok_s": 8 * 128 / statistics.median(batch8),  # includes 8x128-token prefill
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    print(f"| figure | {ns.backend} ({llm.args.dtype}) |\n|---|---|")
    for name, value in figures.items():
        print(f"| {name} | {value:.1f} |")
    if ns.json:
        ns.json.write_text(json.dumps({"machine": platform.node(), "backend": ns.backend, "dtype": ns.dtype,
                                       "runs": ns.runs, "figures": figures,
                                       "raw_s": {"prefill": prefill, "decode": single, "batch8": batch8}}, indent=2))


if __name__ == "__main__":
    main()
