"""Structured outputs' cost: decode tok/s with and without a JSON-schema constraint, at batch 1 and 8.

    python -m pocketbench.structured [--model smollm2-135m-instruct] [--backend torch] [--repeats 5] [--out results/]

Greedy chat requests asking for a person as JSON; the unconstrained side generates as many tokens as the
constrained one did (ignore_eos), so both time the same number of steps. Also the grammar's own costs: compile
time of the schema, and the mask time per token (llguidance's fill of the next-token bitmask). Prints a table and
writes ``<date>-<machine>-structured.{md,json}``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from pocketbench.machine import write_report
from pocketllm import LLM, SamplingParams
from pocketllm.structured import GrammarCompiler, StructuredOutputs, bitmask_words

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "maxLength": 24}, "hobbies": {"type": "array", "items": {"type": "string",
                                                                                       "maxLength": 16},
                                                             "maxItems": 3}},
    "required": ["name", "age", "city", "hobbies"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON: name, age, city and hobbies."}]


def run(llm: LLM, batch: int, params: SamplingParams) -> tuple[float, int]:
    started = time.perf_counter()
    outs = llm.chat([MESSAGES] * batch, params)
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description="decode with and without a JSON-schema constraint")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    args = parser.parse_args()
    llm = LLM(args.model, backend=args.backend, max_num_seqs=8)
    constrained = SamplingParams(temperature=0.0, max_tokens=160,
                                 structured_outputs=StructuredOutputs(json=SCHEMA))
    results = {}
    try:
        # Warm-up: the grammar compiler's tokenizer, and the decode traces of each batch size (recorded once).
        for batch in (1, 8):
            run(llm, batch, constrained)
        for batch in (1, 8):
            # Alternating pairs, their medians: on a shared machine one pair can differ by 10% either way.
            constrained_rates, free_rates, slowdowns = [], [], []
            for _ in range(args.repeats):
                seconds, tokens = run(llm, batch, constrained)
                free = SamplingParams(temperature=0.0, max_tokens=tokens // batch, ignore_eos=True)
                free_seconds, free_tokens = run(llm, batch, free)
                constrained_rates.append(tokens / seconds)
                free_rates.append(free_tokens / free_seconds)
                slowdowns.append(1 - constrained_rates[-1] / free_rates[-1])
            results[f"batch {batch}"] = {"constrained_tok_s": statistics.median(constrained_rates),
                                         "free_tok_s": statistics.median(free_rates),
                                         "slowdown_median": statistics.median(slowdowns),
                                         "slowdowns": slowdowns}
        compiler = GrammarCompiler(llm.tokenizer, llm.model_config.vocab_size)
        compiler.constraint(StructuredOutputs(regex="warm"))
        started = time.perf_counter()
        constraint = compiler.constraint(StructuredOutputs(json=SCHEMA | {"title": "fresh"}))
        compile_ms = (time.perf_counter() - started) * 1e3
        mask = np.zeros(bitmask_words(compiler.vocab_size), np.int32)
        # Compact, as the grammar allows no whitespace between JSON tokens.
        text = llm.tokenizer.encode('{"name":"Ann","age":30,"city":"Oslo","hobbies":["chess"]}',
                                    add_special_tokens=False)
        started = time.perf_counter()
        for token in text:
            constraint.fill_bitmask(mask)
            constraint.accept(token)
        assert constraint.error is None, constraint.error
        mask_us = (time.perf_counter() - started) / len(text) * 1e6
    finally:
        llm.shutdown()
    lines = [f"# Structured outputs, {args.model} on {args.backend}", "",
             f"Medians of {args.repeats} alternating pairs.", "",
             "| batch | free tok/s | JSON-schema tok/s | slowdown (median of pairs) | pairs |", "|---|---|---|---|---|",
             *(f"| {name} | {r['free_tok_s']:.1f} | {r['constrained_tok_s']:.1f} | {r['slowdown_median']:.1%} | "
               f"{', '.join(f'{x:.1%}' for x in r['slowdowns'])} |" for name, r in results.items()), "",
             f"Schema compile: {compile_ms:.2f} ms; mask per token (fill + accept): {mask_us:.0f} us."]
    write_report(args.out, f"structured-{args.backend}", "\n".join(lines) + "\n",
                 {"decode": results, "compile_ms": compile_ms, "mask_us": mask_us})


if __name__ == "__main__":
    main()
