"""Tensor parallelism on this machine's CPUs: TP=2 with one thread per rank against TP=1 with two threads.

    python -m pocketbench.tensor_parallel [--model smollm2-135m-instruct] [--out results/]

Per side: single-stream decode tok/s and batch-8 aggregate decode tok/s (128-token prompts, 64 new tokens: the
time of 64 less the time of 1), torch backend in float32. Communication: the time of one gloo all-reduce of a
decode step's hidden rows (1 and 8 rows) between two processes, times the collectives a step runs (two per
layer, the embedding's, the logits' gather and the step broadcast). Prints a table and writes
``<date>-<machine>-tensor-parallel.{md,json}``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from pocketbench.machine import write_report
from pocketllm import LLM, SamplingParams

PROMPT, TOKENS = 128, 64


def decode(model: str, tp: int, threads: int, batch: int) -> float:
    llm = LLM(model, backend="torch", dtype="float32", tensor_parallel_size=tp, max_num_seqs=8,
              backend_options={"num_threads": threads})
    prompts = [np.random.default_rng(i).integers(100, 20000, PROMPT).tolist() for i in range(batch)]

    def run(tokens: int) -> float:
        started = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
        return time.perf_counter() - started

    try:
        run(4)
        prefill = run(1)
        return batch * (TOKENS - 1) / (run(TOKENS) - prefill)
    finally:
        llm.shutdown()


def _all_reduce_rank(rank: int, port: int, hidden: int, out: dict) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for rows in (1, 8):
        x = torch.randn(rows, hidden)
        for _ in range(50):
            dist.all_reduce(x)
        started = time.perf_counter()
        for _ in range(500):
            dist.all_reduce(x)
        if rank == 0:
            out[rows] = (time.perf_counter() - started) / 500
    dist.destroy_process_group()


def all_reduce_seconds(hidden: int) -> dict[int, float]:
    import multiprocessing

    from pocketllm.tensor_parallel import free_port

    port = free_port()
    with multiprocessing.Manager() as manager:
        out = manager.dict()
        procs = [multiprocessing.get_context("spawn").Process(target=_all_reduce_rank, args=(r, port, hidden, out))
                 for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        return dict(out)


def main() -> None:
    parser = argparse.ArgumentParser(description="TP=2 (1 thread per rank) against TP=1 (2 threads) on CPU")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    args = parser.parse_args()
    figures = {f"TP={tp}, batch {b}": decode(args.model, tp, threads, b)
               for tp, threads in ((1, 2), (2, 1)) for b in (1, 8)}
    llm = LLM(args.model, backend="torch", dtype="float32")
    config = llm.model_config
    llm.shutdown()
    reduce = all_reduce_seconds(config.hidden_size)
    collectives = 2 * config.num_hidden_layers + 4
    lines = [f"# Tensor parallelism on CPU ({os.cpu_count()} cores), {args.model}, torch backend float32", "",
             "| engine | decode tok/s |", "|---|---|", *(f"| {k} | {v:.1f} |" for k, v in figures.items()), "",
             f"TP=2 / TP=1: batch 1 {figures['TP=2, batch 1'] / figures['TP=1, batch 1']:.2f}x, batch 8 "
             f"{figures['TP=2, batch 8'] / figures['TP=1, batch 8']:.2f}x.", "",
             f"One gloo all-reduce of the hidden rows ({config.hidden_size} floats per row): "
             f"{reduce[1] * 1e6:.0f} us at 1 row, {reduce[8] * 1e6:.0f} us at 8; a step runs ~{collectives} "
             f"collectives: ~{collectives * reduce[1] * 1e3:.1f} ms of communication per decode step at batch 1, "
             f"~{collectives * reduce[8] * 1e3:.1f} ms at 8."]
    write_report(args.out, "tensor-parallel", "\n".join(lines) + "\n",
                 {"decode": figures, "all_reduce_s": reduce, "collectives_per_step": collectives})


if __name__ == "__main__":
    main()
