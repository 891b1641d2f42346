"""Structured outputs' cost: decode tok/s with and without a JSON-schema constraint, at batch 1 and 8.

    python -m pocketbench.structured [--model smollm2-135m-instruct] [--backend torch] [--out results/]

Greedy chat requests asking for a person as JSON; the unconstrained side generates as many tokens as the
constrained one did (ignore_eos), so both time the same number of steps. Also the grammar's own costs: compile
time of the schema, and the mask time per token (llguidance's fill of the next-token bitmask). Prints a table and
writes ``<date>-<machine>-structured.{md,json}``.
"""

from __future__ import annotations

import argparse
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
            seconds, tokens = run(llm, batch, constrained)
            free = SamplingParams(temperature=0.0, max_tokens=tokens // batch, ignore_eos=True)
            free_seconds, free_tokens = run(llm, batch, free)
            results[f"batch {batch}"] = {"constrained_tok_s": tokens / seconds,
                                         "free_tok_s": free_tokens / free_seconds}
        compiler = GrammarCompiler(llm.tokenizer, llm.driver.model_config.vocab_size)
        compiler.constraint(StructuredOutputs(regex="warm"))
        started = time.perf_counter()
        constraint = compiler.constraint(StructuredOutputs(json=SCHEMA | {"title": "fresh"}))
        compile_ms = (time.perf_counter() - started) * 1e3
        mask = np.zeros(bitmask_words(compiler.vocab_size), np.int32)
        text = llm.tokenizer.encode('{"name": "Ann", "age": 30, "city": "Oslo", "hobbies": ["chess"]}',
                                    add_special_tokens=False)
        started = time.perf_counter()
        for token in text:
            constraint.fill_bitmask(mask)
            constraint.accept(token)
        mask_us = (time.perf_counter() - started) / len(text) * 1e6
    finally:
        llm.shutdown()
    lines = [f"# Structured outputs, {args.model} on {args.backend}", "",
             "| batch | free tok/s | JSON-schema tok/s | slowdown |", "|---|---|---|---|",
             *(f"| {name} | {r['free_tok_s']:.1f} | {r['constrained_tok_s']:.1f} | "
               f"{1 - r['constrained_tok_s'] / r['free_tok_s']:.1%} |" for name, r in results.items()), "",
             f"Schema compile: {compile_ms:.2f} ms; mask per token (fill + accept): {mask_us:.0f} us."]
    write_report(args.out, "structured", "\n".join(lines) + "\n",
                 {"decode": results, "compile_ms": compile_ms, "mask_us": mask_us})


if __name__ == "__main__":
    main()
