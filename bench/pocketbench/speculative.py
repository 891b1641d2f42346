"""Speculative decoding side by side, in one run: PocketLLM cpp with ngram drafts and without, beside llama.cpp's
llama-server plain and with its own n-gram speculation, on the default model, greedy, the same prompt token ids,
2 threads each, one engine at a time.

    python -m pocketbench.speculative --llama-server PATH [--model M] [--threads 2] [--runs 3] [--new-tokens 256]
        [--k 8] [--batches 1 2 4 8] [--out results/]

Workloads (the prompts are below, in the default model's chat template):

* ``edit``: answers that copy most of their prompt (a paragraph with one word changed, or its spelling corrected;
  code copied, which the default model does only in part):
  where prompt lookup pays. Single stream: decode tok/s after the first token, and the drafts' acceptance. Every
  answer ends where the model ends it (EOS) or at --new-tokens: past its natural end a reply is new text.
* ``fresh``: answers that do not repeat their prompt (a story, a list of ideas): speculation must cost little
  there (its drafts are few and mostly rejected, and pause).
* ``batch``: N edit requests at once, PocketLLM with drafts on and off (``speculative_disable_by_batch_size``
  lifted): aggregate decode tok/s, and the batch size from which drafting stops paying.

All four engines stay loaded, and take turns prompt by prompt, run by run. llama-server reports its own generation
speed (``timings.predicted_per_second``: tokens after the first over the
time after the first), and PocketLLM's is measured the same way, from its stream. llama-server is built from the
llama-cpp-python sdist's vendored llama.cpp (``--target llama-server``, GGML_NATIVE=ON); its n-gram speculation is
``--spec-type ngram-simple`` with its defaults (a 12-token lookup, drafts of up to 48), the closest to our
lookup. Each figure is the
median of --runs runs after a warm-up. Prints a table, writes
``<date>-<machine>-speculative.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from pocketbench.machine import write_report
from pocketllm import LLM, SamplingParams
from pocketllm.args import DEFAULT_MODEL
from pocketllm.checkpoint import load_checkpoint

PARAGRAPH = (
    "The lighthouse stood at the end of the northern pier for more than a century. Every evening the keeper climbed "
    "the one hundred and twelve steps, trimmed the wick, polished the great lens and watched the ships come home "
    "through the fog. In winter the waves broke over the rail and froze on the stones, and in summer children ran "
    "along the pier to count the gulls. When the harbour was rebuilt, the town voted to keep the lighthouse as it "
    "was, and the keeper's cottage became a small museum about the sea.")
CODE = '''def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    total = subtotal + tax
    return round(total, 2)


def cheapest_item(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
EDIT = [f"Rewrite this paragraph exactly, word for word, but change 'northern' to 'southern':\n\n{PARAGRAPH}",
        f"Correct the spelling in this paragraph and repeat it:\n\n{PARAGRAPH.replace('keeper', 'keepr')}",
        f"Copy this Python code, unchanged:\n```python\n{CODE}```"]
FRESH = ["Write a short story about a fox who learns to paint.",
         "List ten ideas for a science fair project, with one sentence about each."]


def prompt_ids(llm: LLM, text: str) -> list[int]:
    return llm.render_chat([{"role": "user", "content": text}])[1]


def pocket_decode(llm: LLM, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
    """Decode tok/s after the first token, and the tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    tokens: list[int] = []
    first = last = 0.0
    for event in llm.generate_stream(ids, params):
        if not tokens:
            first = time.perf_counter()
        tokens += event.token_ids
        last = time.perf_counter()
    return (len(tokens) - 1) / (last - first), tokens


def pocket_batch(llm: LLM, ids: list[list[int]], new_tokens: int) -> float:
    """Aggregate tok/s of the requests' tokens after their first, from the first token of any to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens)
    streams = [llm.generate_stream(p, params) for p in ids]
    start = None
    count = 0
    for stream in streams:  # the engine runs them all at once; reading them in turn only buffers
        for event in stream:
            start = start or time.perf_counter()
            count += len(event.token_ids)
    assert start is not None
    return (count - len(ids)) / (time.perf_counter() - start)


class LlamaServer:
    """A llama-server process on a free port; ``decode`` posts to /completion."""

    def __init__(self, binary: Path, model: Path, threads: int, spec: list[str]) -> None:
        """``spec``: its speculative-decoding arguments (none: plain decoding)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        args = [str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1",
                "--port", str(self.port), "--host", "127.0.0.1", "--no-webui", *spec]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        self.close()
        raise RuntimeError("llama-server did not come up")

    def decode(self, ids: list[int], new_tokens: int) -> tuple[float, dict[str, Any]]:
        body = json.dumps({"prompt": ids, "n_predict": new_tokens, "temperature": 0.0, "top_k": 1,
                           "cache_prompt": False}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as r:
            timings = json.loads(r.read())["timings"]
        return float(timings["predicted_per_second"]), timings

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)


Speeds = dict[tuple[str, str], list[float]]


def take_turns(engines: dict[str, Any], prompts: dict[str, list[int]], new_tokens: int, runs: int,
               notes: dict[str, Any], outputs: dict[str, list[list[int]]]) -> Speeds:
    """Every engine on every prompt in turn, ``runs`` times after a warm-up: decode tok/s per (engine, prompt);
    llama-server's drafted and accepted counts into ``notes``, PocketLLM's tokens into ``outputs``."""
    speeds: Speeds = {}
    for run in range(runs + 1):  # the first is a warm-up
        for label, ids in prompts.items():
            for kind, e in engines.items():
                if isinstance(e, LlamaServer):
                    speed, timings = e.decode(ids, new_tokens)
                    notes[f"{kind}, {label}: drafted, accepted"] = [timings.get("draft_n"),
                                                                    timings.get("draft_n_accepted")]
                else:
                    speed, tokens = pocket_decode(e, ids, new_tokens)
                    outputs.setdefault(kind, []).append(tokens)
                if run:
                    speeds.setdefault((kind, label), []).append(speed)
    return speeds


def speed_table(engines: tuple[str, ...], rows: list[str], medians: dict[tuple[str, str], float],
                ratios: list[tuple[int, int]]) -> list[str]:
    """A markdown table: each prompt's tok/s per engine, then the ratios engines[a] / engines[b] asked for."""
    short = [e.removeprefix("pocketllm-").replace(" + ", "+") for e in engines]
    lines = ["| prompt | " + " | ".join(engines) + "".join(f" | {short[a]} / {short[b]}" for a, b in ratios) + " |",
             "|---" * (len(engines) + len(ratios) + 1) + "|"]
    for row in rows:
        m = [medians[(kind, row)] for kind in engines]
        lines.append(f"| {row} | " + " | ".join(f"{v:.1f}" for v in m) +
                     "".join(f" | {m[a] / m[b]:.2f}x" for a, b in ratios) + " |")
    return lines


@contextmanager
def engine(kind: str, model: str, path: Path, args: argparse.Namespace) -> Iterator[Any]:
    if kind.startswith("llama.cpp"):
        # its n-gram speculation with its own defaults: a 12-token lookup, drafts of up to 48
        server = LlamaServer(args.llama_server, path, args.threads,
                             ["--spec-type", "ngram-simple"] if "ngram" in kind else [])
        try:
            yield server
        finally:
            server.close()
        return
    spec = {"speculative_method": "ngram", "num_speculative_tokens": args.k,
            "speculative_disable_by_batch_size": max(args.batches)} if "ngram" in kind else {}
    llm = LLM(model, backend="cpp", backend_options={"num_threads": args.threads}, show_progress=False,
              max_num_seqs=max(args.batches), **spec)
    try:
        yield llm
    finally:
        llm.shutdown()


ENGINES = ("pocketllm-cpp", "pocketllm-cpp + ngram", "llama.cpp", "llama.cpp + ngram")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", type=Path, required=True)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=8, help="PocketLLM's num_speculative_tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    args = parser.parse_args()
    path = load_checkpoint(args.model).path
    notes: dict[str, Any] = {}
    outputs: dict[str, list[list[int]]] = {}
    with ExitStack() as stack:
        engines = {kind: stack.enter_context(engine(kind, args.model, path, args)) for kind in ENGINES}
        edit, fresh = ([prompt_ids(engines["pocketllm-cpp"], t) for t in texts] for texts in (EDIT, FRESH))
        labelled = {f"{workload} {i}": ids for workload, prompts in (("edit", edit), ("fresh", fresh))
                    for i, ids in enumerate(prompts)}
        speeds = take_turns(engines, labelled, args.new_tokens, args.runs, notes, outputs)
        stats = engines["pocketllm-cpp + ngram"].stats()
        notes["pocketllm-cpp + ngram, single streams: drafts, drafted, accepted"] = [
            stats.num_spec_drafts, stats.num_spec_draft_tokens, stats.num_spec_accepted_tokens]
        for _ in range(args.runs):
            for batch in args.batches:
                for kind in ENGINES[:2]:
                    speeds.setdefault((kind, f"batch {batch}"), []).append(
                        pocket_batch(engines[kind], (edit * batch)[:batch], args.new_tokens))
    same = outputs["pocketllm-cpp"] == outputs["pocketllm-cpp + ngram"]
    rows = [f"{w} {i}" for w, prompts in (("edit", edit), ("fresh", fresh)) for i in range(len(prompts))]
    medians = {key: statistics.median(values) for key, values in speeds.items()}
    lines = [f"# Speculative decoding, {args.model}, {args.threads} threads, greedy, {args.new_tokens} new tokens, "
             f"k = {args.k}", "",
             f"Decode tok/s after the first token, median of {args.runs} runs. PocketLLM's outputs with and without "
             f"drafts {'are' if same else 'are NOT'} the same tokens.", "",
             *speed_table(ENGINES, rows, medians, [(1, 2), (1, 3), (1, 0)])]
    lines += ["", "Aggregate decode tok/s of N edit requests at once (PocketLLM):", "",
              "| requests | without drafts | with drafts | ratio |", "|---|---|---|---|"]
    for batch in args.batches:
        off, on = medians[("pocketllm-cpp", f"batch {batch}")], medians[("pocketllm-cpp + ngram", f"batch {batch}")]
        lines.append(f"| {batch} | {off:.1f} | {on:.1f} | {on / off:.2f}x |")
    lines += ["", "Drafts (drafts, draft tokens, accepted): " + json.dumps(notes)]
    write_report(args.out, "speculative", "\n".join(lines) + "\n",
                 {"speeds": {f"{k} | {w}": v for (k, w), v in speeds.items()}, "notes": notes, "same": same,
                  "args": {k: str(v) for k, v in vars(args).items()}})


if __name__ == "__main__":
    main()
