"""llguidance (what PocketLLM uses) against xgrammar on JSON schemas with the default model's vocabulary:
compile time per schema and next-token mask time per token, side by side in one process.

    python -m pocketbench.grammar_engines [--model smollm2-135m-instruct] [--out results/]

xgrammar is a bench-only peer (installed by ``nox -s bench`` with ``--no-deps``: its wheel asks for torch,
transformers and triton, and the mask needs none of them on a CPU). Each schema's instance is encoded as compact
JSON (both engines set to allow no whitespace between tokens) and walked token by token: fill the bitmask, then
accept the token. Prints a table and writes ``<date>-<machine>-grammar_engines.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pocketbench.machine import write_report
from pocketllm.checkpoint import load_checkpoint
from pocketllm.tokenizer import Tokenizer

# (schema, an instance of it): flat, nested with enums and arrays, and a wide one.
CASES: list[tuple[dict[str, Any], Any]] = [
    ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
      "required": ["name", "age"], "additionalProperties": False},
     {"name": "Ada Lovelace", "age": 36}),
    ({"type": "object", "properties": {
        "person": {"type": "object", "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                   "required": ["first", "last"], "additionalProperties": False},
        "weather": {"enum": ["sunny", "rainy", "cloudy"]},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 31}},
        "ok": {"type": "boolean"}},
      "required": ["person", "weather", "days", "ok"], "additionalProperties": False},
     {"person": {"first": "Grace", "last": "Hopper"}, "weather": "rainy", "days": [1, 2, 30], "ok": True}),
    ({"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 20} for i in range(24)},
      "required": [f"field_{i}" for i in range(24)], "additionalProperties": False},
     {f"field_{i}": f"value number {i}" for i in range(24)}),
]


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    result = call()
    return result, time.perf_counter() - started


def llguidance_engine(tokenizer: Tokenizer, vocab_size: int) -> tuple[float, Callable[..., tuple[float, list]]]:
    import llguidance
    import llguidance.numpy

    ll, setup = timed(lambda: llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                                     eos_token=list(tokenizer.eos_token_ids) or None))

    def run(schema: dict[str, Any], ids: list[int]) -> tuple[float, list[float]]:
        def compile_() -> Any:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
            return llguidance.LLMatcher(ll, grammar, log_level=0)

        matcher, seconds = timed(compile_)
        mask = np.zeros((1, (vocab_size + 31) // 32), np.int32)
        steps = []
        for token in ids:
            started = time.perf_counter()
            llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
            steps.append(time.perf_counter() - started)
            assert (mask[0, token // 32] >> (token % 32)) & 1, "llguidance refused a token of a valid instance"
            matcher.consume_token(token)
        return seconds, steps

    return setup, run


def xgrammar_engine(model: Path, vocab_size: int) -> tuple[float, Callable[..., tuple[float, list]]]:
    import transformers
    import xgrammar

    hf = transformers.AutoTokenizer.from_pretrained(str(model.parent), gguf_file=model.name)  # not timed: GGUF parse
    info, setup = timed(lambda: xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size))

    def run(schema: dict[str, Any], ids: list[int]) -> tuple[float, list[float]]:
        compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        compiled, seconds = timed(lambda: compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                                       separators=(",", ":")))
        matcher = xgrammar.GrammarMatcher(compiled)
        mask = xgrammar.allocate_token_bitmask(1, vocab_size)
        steps = []
        for token in ids:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            steps.append(time.perf_counter() - started)
            assert matcher.accept_token(token), "xgrammar refused a token of a valid instance"
        return seconds, steps

    return setup, run


def main() -> None:
    parser = argparse.ArgumentParser(description="llguidance against xgrammar on JSON schemas")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    args = parser.parse_args()
    checkpoint = load_checkpoint(args.model)
    tokenizer = Tokenizer.from_checkpoint(checkpoint)
    vocab_size = checkpoint.config.vocab_size
    engines = {"llguidance": llguidance_engine(tokenizer, vocab_size),
               "xgrammar": xgrammar_engine(Path(checkpoint.path), vocab_size)}
    figures: dict[str, Any] = {}
    for name, (setup, run) in engines.items():
        compiles, steps = [], []
        for _ in range(args.repeats):
            for schema, instance in CASES:
                ids = tokenizer.encode(json.dumps(instance, separators=(",", ":")), add_special_tokens=False)
                seconds, per_token = run(schema, ids)
                compiles.append(seconds)
                steps += per_token
        figures[name] = {"tokenizer_setup_ms": setup * 1e3, "compile_ms_median": statistics.median(compiles) * 1e3,
                         "mask_us_median": statistics.median(steps) * 1e6,
                         "mask_us_p99": float(np.percentile(steps, 99)) * 1e6, "tokens": len(steps)}
    lines = [f"# Grammar engines on {args.model}'s vocabulary ({vocab_size} tokens), {len(CASES)} JSON schemas",
             "", "| engine | tokenizer setup ms | compile ms (median) | mask us/token (median) | mask us p99 |",
             "|---|---|---|---|---|",
             *(f"| {name} | {f['tokenizer_setup_ms']:.0f} | {f['compile_ms_median']:.2f} | "
               f"{f['mask_us_median']:.1f} | {f['mask_us_p99']:.1f} |" for name, f in figures.items())]
    write_report(args.out, "grammar_engines", "\n".join(lines) + "\n", figures)


if __name__ == "__main__":
    main()
