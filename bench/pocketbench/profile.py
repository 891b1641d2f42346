"""Where a decode step of the cpp backend goes, against the machine's memory bandwidth.

    python -m pocketbench.profile [--model M] [--threads 2] [--context 128 512] [--sequences 1] [--out results/]

Per context length: ``--sequences`` prompts of that many tokens, decoding side by side, 128 greedy tokens each,
timed from the step after every prompt's first token. The
engine's own profile (``Engine.profile``: clocks around each phase of every step) splits the step into the
layers' weight products, the vocabulary projection, attention (norms, RoPE, KV writes and reads), the state
layers' recurrence (Qwen3.5's Gated DeltaNet: conv, delta rule, gated norm), other layer work, the caller waiting
for worker threads at the end of parallel regions (imbalance and synchronisation), sampling and scheduling; what
the caller saw beyond the steps is the Python boundary (the core's driver, its engine thread and the stream). The
bound: bytes a decode step must move (every weight matrix but the embedding table, the KV of the context in the
attention layers, and a state layer's state read and written; the last two per sequence) over the machine's read
bandwidth, measured here with the same threads.
Prints a table and writes ``<date>-<machine>-profile.{md,json}`` (``-profile-<model file's stem>`` for a model
other than the default, then ``-<N>seq`` for N sequences).
"""

from __future__ import annotations

import argparse
import datetime
import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from pocketllm_cpp.model import num_attention_layers, state_slot_bytes

from pocketbench.machine import describe, machine_name
from pocketllm import LLM, SamplingParams
from pocketllm.args import DEFAULT_MODEL
from pocketllm.checkpoint import Checkpoint, load_checkpoint

NEW_TOKENS = 128
PHASES = ("matmul", "lm_head", "attention", "recurrence", "other", "wait", "sample", "schedule", "python")


def read_bandwidth(threads: int, size: int = 256 << 20) -> float:
    """Bytes per second that `threads` threads read from memory (numpy sums release the GIL), best of 5."""
    parts = [np.ones(size // 8 // threads) for _ in range(threads)]
    best = 0.0
    for _ in range(5):
        workers = [threading.Thread(target=np.sum, args=(p,)) for p in parts]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, size / (time.perf_counter() - start))
    return best


def weight_bytes(checkpoint: Checkpoint) -> int:
    """Bytes of the matrices a decode step reads: all but the embedding table (one row of it), lm_head included."""
    tensors = {t.name: t for t in checkpoint.tensors()}
    total = sum(t.nbytes for name, t in tensors.items() if len(t.shape) == 2 and name != "model.embed_tokens.weight")
    if checkpoint.config.tie_word_embeddings:
        total += tensors["model.embed_tokens.weight"].nbytes
    return total


def profile(llm: Any, context: int, sequences: int) -> dict[str, float]:
    """Milliseconds per decode step of `sequences` sequences of `context` prompt tokens each, per phase."""
    engine = llm.backend_engine.engine  # the native engine of pocketllm_cpp.backend.CppEngine
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    streams = [llm.generate_stream(np.random.default_rng([context, s]).integers(100, 20000, context).tolist(), params)
               for s in range(sequences)]
    for stream in streams:  # every prompt prefilled: what follows are decode steps
        next(stream)
    engine.reset_profile()
    start = time.perf_counter()
    # The tokens the timed steps gave (sequences that started early also end early: the last steps run fewer).
    produced = sum(len(event.token_ids) for stream in streams for event in stream)
    wall = time.perf_counter() - start
    p = engine.profile()
    steps = p.steps
    per = {k: getattr(p, k) / steps * 1e3 for k in ("step", "matmul", "lm_head", "attention", "recurrence", "wait",
                                                     "sample", "schedule")}
    per["other"] = (p.forward - p.matmul - p.lm_head - p.attention - p.recurrence) / steps * 1e3
    per["python"] = wall / steps * 1e3 - per["step"]
    per["token"] = wall / steps * 1e3  # a step's
    per["tok_s"] = produced / wall
    per["regions"] = p.regions / steps
    return per


def main() -> None:
    parser = argparse.ArgumentParser(description="decode-step profile of the cpp backend")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--sequences", type=int, default=1, help="sequences decoding side by side")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    args = parser.parse_args()
    llm = LLM(args.model, backend="cpp", backend_options={"num_threads": args.threads})
    config = llm.model_config
    checkpoint = load_checkpoint(args.model)
    weights = weight_bytes(checkpoint)
    # A decode step also reads and writes each state layer's state (Gated DeltaNet), once each.
    state = 2 * state_slot_bytes(checkpoint)
    attention_layers = num_attention_layers(checkpoint)
    bandwidth = read_bandwidth(args.threads)
    rows = []
    for context in args.context:
        per = profile(llm, context, args.sequences)
        average = context + NEW_TOKENS // 2
        kv = average * attention_layers * 2 * config.num_key_value_heads * config.head_dim * 2  # float16
        step_bytes = weights + args.sequences * (kv + state)
        rows.append({"context": context, "ms": per, "bytes_per_step": step_bytes,
                     "bound_ms": step_bytes / bandwidth * 1e3})
    llm.shutdown()
    lines = [f"# Decode-step profile: cpp backend, {args.model}, {args.threads} threads, "
             f"{args.sequences} sequence{'s' if args.sequences > 1 else ''}", "",
             f"Read bandwidth ({args.threads} threads, numpy): {bandwidth / 1e9:.1f} GB/s; weights read per token: "
             f"{weights / 1e6:.1f} MB; state layers' state read and written per token: {state / 1e6:.1f} MB.", "",
             "| context | tok/s | ms/step | " + " | ".join(PHASES)
             + " | regions | bound ms | bound tok/s | of bound |",
             "|---" * (len(PHASES) + 7) + "|"]
    for row in rows:
        per = row["ms"]
        lines.append(f"| {row['context']} | {per['tok_s']:.0f} | {per['token']:.2f} | "
                     + " | ".join(f"{per[k]:.2f}" for k in PHASES)
                     + f" | {per['regions']:.0f} | {row['bound_ms']:.2f} | "
                     f"{args.sequences * 1e3 / row['bound_ms']:.0f} | "
                     f"{row['bound_ms'] / per['token']:.0%} |")
    report = "\n".join(lines) + "\n"
    print(report)
    # The default model's profile, and beside it one per other model (the Qwen3.5 GGUF's, for example).
    suffix = "" if args.model == DEFAULT_MODEL else f"-{Path(args.model).stem}"
    suffix += f"-{args.sequences}seq" if args.sequences > 1 else ""
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"{datetime.date.today().isoformat()}-{machine_name()}-profile{suffix}"
    Path(f"{stem}.md").write_text(report)
    Path(f"{stem}.json").write_text(json.dumps({"machine": describe(), "model": args.model,
                                                     "threads": args.threads, "sequences": args.sequences,
                                                     "bandwidth": bandwidth,
                                                     "weight_bytes": weights, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
