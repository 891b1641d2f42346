"""The shared-prefix workload on a hybrid model: prefix caching of Gated DeltaNet states, measured.

    python -m pocketbench.shared_prefix [--requests 32] [--prefix 2048] [--question 64] [--threads 2] [--out results/]

Writes a tiny-width but deep random Qwen3.5 (24 layers: 18 Gated DeltaNet, 6 gated attention; hidden 128) with
transformers' own class, so that prefill dominates on CPU. Then, on the torch backend in float32:

- shared prefix: one request with the shared system prompt warms the cache, then ``--requests`` requests, each
  the same prompt plus its own question, are submitted at once, ``--max-tokens`` tokens each; with prefix
  caching on and off. Per side: TTFT p50/p99 (submission -> first token), aggregate tok/s (all tokens of the 32
  / wall time), and with caching the hit rate: cached prompt tokens / shared-prefix tokens of the 32 requests.
- decode: single-stream and batch-8 decode tok/s (128-token prompts, 64 new tokens: the time of 64 less the time
  of 1, for both engines), beside transformers' ``generate`` on the same weights (float32, same threads).

Prints a table and writes ``<date>-<machine>-shared-prefix.{md,json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from pocketbench.machine import write_report
from pocketllm import LLM, AsyncLLM, SamplingParams
from pocketllm.testing import checkpoints

DECODE_PROMPT, DECODE_TOKENS = 128, 64


def write_model(path: Path) -> Any:
    """The bench's Qwen3.5 checkpoint at ``path`` (with the kit's tokenizer); returns the transformers model."""
    import torch
    import transformers

    layers = 24
    config = transformers.Qwen3_5TextConfig(
        vocab_size=len(checkpoints._vocab()), hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=checkpoints.EOS_TOKEN_ID,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(config).eval()
    model.save_pretrained(path)
    checkpoints._write_tokenizer(path)
    return model


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def shared_prefix(path: Path, args: argparse.Namespace, caching: bool) -> dict[str, float]:
    llm = AsyncLLM(str(path), backend="torch", dtype="float32", enable_prefix_caching=caching,
                   max_num_seqs=args.requests, max_model_len=args.prefix + args.question + args.max_tokens + 16,
                   backend_options={"num_threads": args.threads})
    rng = np.random.default_rng(1)
    vocab = llm.model_config.vocab_size
    prefix = rng.integers(3, vocab, args.prefix).tolist()
    questions = [rng.integers(3, vocab, args.question).tolist() for _ in range(args.requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    async def one(ids: list[int]) -> tuple[float, int]:
        start, first, tokens = time.perf_counter(), None, 0
        async for event in llm.stream_ids(ids, params):
            first = first or time.perf_counter()
            tokens += len(event.token_ids)
        assert first is not None
        return first - start, tokens

    async def run() -> dict[str, float]:
        await one([*prefix, 5])  # the system prompt seen once before
        before = llm.stats()
        started = time.perf_counter()
        results = await asyncio.gather(*(one(prefix + q) for q in questions))
        wall = time.perf_counter() - started
        stats = llm.stats()
        ttft = [r[0] * 1e3 for r in results]
        hits = stats.num_prefix_cache_hits - before.num_prefix_cache_hits
        return {"ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
                "tok_s": sum(r[1] for r in results) / wall, "hit_rate": hits / (args.prefix * args.requests),
                "snapshot_hits": stats.num_state_snapshot_hits - before.num_state_snapshot_hits}

    try:
        return asyncio.run(run())
    finally:
        llm.shutdown()


def decode_prompts(batch: int) -> list[list[int]]:
    """The same random token-id prompts for both engines."""
    vocab = len(checkpoints._vocab())
    return [np.random.default_rng(i).integers(3, vocab, DECODE_PROMPT).tolist() for i in range(batch)]


def decode_pocketllm(path: Path, threads: int, batch: int) -> float:
    llm = LLM(str(path), backend="torch", dtype="float32", max_num_seqs=8, max_model_len=512,
              backend_options={"num_threads": threads})
    prompts = decode_prompts(batch)

    def run(tokens: int) -> float:
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - started

    try:
        run(4)  # warm-up
        prefill = run(1)
        return batch * (DECODE_TOKENS - 1) / (run(DECODE_TOKENS) - prefill)
    finally:
        llm.shutdown()


def decode_transformers(model: Any, threads: int, batch: int) -> float:
    import torch

    torch.set_num_threads(threads)
    ids = torch.tensor(decode_prompts(batch))
    model.generation_config.eos_token_id = None

    def run(tokens: int) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
        return time.perf_counter() - started

    run(4)  # warm-up
    prefill = run(1)
    return batch * (DECODE_TOKENS - 1) / (run(DECODE_TOKENS) - prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description="shared-prefix and decode workloads on a hybrid Qwen3.5")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--question", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        hf = write_model(path)
        runs = {side: shared_prefix(path, args, caching) for side, caching in (("on", True), ("off", False))}
        # PocketLLM first: once transformers has run in this process, its OpenMP threads spin on the cores the
        # engine thread's own would use (measured: a third of PocketLLM's batch-8 rate).
        decode = {f"pocketllm-torch, batch {b}": decode_pocketllm(path, args.threads, b) for b in (1, 8)}
        decode |= {f"transformers, batch {b}": decode_transformers(hf, args.threads, b) for b in (1, 8)}
    on, off = runs["on"], runs["off"]
    lines = [f"# Shared prefix on a hybrid Qwen3.5 (24 layers, hidden 128), torch backend float32, {args.threads} "
             "threads", "",
             f"{args.requests} requests at once, each a shared {args.prefix}-token prompt (seen once before) plus its "
             f"own {args.question}-token question, {args.max_tokens} tokens each.", "",
             "| prefix caching | TTFT p50 ms | TTFT p99 ms | aggregate tok/s | hit rate of shared tokens |",
             "|---|---|---|---|---|",
             *(f"| {side} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['tok_s']:.1f} | "
               f"{r['hit_rate']:.1%} |" for side, r in runs.items()), "",
             f"TTFT p50 off / on: {off['ttft_p50_ms'] / on['ttft_p50_ms']:.1f}x; aggregate on / off: "
             f"{on['tok_s'] / off['tok_s']:.1f}x; requests resumed from a state snapshot: {on['snapshot_hits']}.", "",
             "| decode (128-token prompts, 64 new tokens) | tok/s |", "|---|---|",
             *(f"| {name} | {decode[name]:.1f} |" for name in sorted(decode, key=lambda n: (n[-1], n))), "",
             "pocketllm / transformers: batch 1 "
             f"{decode['pocketllm-torch, batch 1'] / decode['transformers, batch 1']:.2f}x, batch 8 "
             f"{decode['pocketllm-torch, batch 8'] / decode['transformers, batch 8']:.2f}x."]
    write_report(args.out, "shared-prefix", "\n".join(lines) + "\n",
                 {"args": {k: str(v) for k, v in vars(args).items()}, "shared_prefix": runs, "decode": decode})


if __name__ == "__main__":
    main()
