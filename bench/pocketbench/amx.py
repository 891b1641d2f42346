"""The cpp backend's AMX tiles against its AVX-512 kernels, on one engine, in one run (a CPU with AMX only).

    python -m pocketbench.amx [--models smollm2-135m-instruct FILE.gguf ...] [--runs 5] [--threads 2]

Per model, one cpp engine; between measurements the kernels' ISA is switched
(``pocketllm_cpp.kernels.set_isa``: ``avx512`` and ``amx`` run by run, in turn first), so both paths see the same
weights, caches and machine state. Timed: a 512-token prefill (one request, one token out), and 16 sequences of
128 prompt tokens decoding 64 tokens each, streamed (end to end, and decode only: the tokens after each sequence's
first over the time from the last first token to the last token). AMX takes only products of 64 or more activation
rows (``kAmxMinRows`` in the kernels): prefill's, not 16 sequences' decode steps, which therefore run the AVX-512
kernels under both names; the table says so. The greedy tokens of both paths are compared (the kernels give the
same bits, so they must be equal). Writes ``<date>-<machine>-amx.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from pathlib import Path

from pocketllm_cpp import kernels

from pocketbench.config import EngineSpec
from pocketbench.engines.pocket import PocketEngine
from pocketbench.machine import describe, machine_name
from pocketbench.prompts import build_prompts
from pocketbench.report import host_line, write_tables
from pocketllm.args import DEFAULT_MODEL
from pocketllm.checkpoint import load_checkpoint

ISAS = ("avx512", "amx")
PREFILL_TOKENS, PROMPT_TOKENS, NEW_TOKENS, SEQUENCES = 512, 128, 64, 16


def measure(model: str, args: argparse.Namespace) -> dict:
    checkpoint = load_checkpoint(model)
    prompts = build_prompts(checkpoint, prefill_tokens=PREFILL_TOKENS, prompt_tokens=PROMPT_TOKENS, count=SEQUENCES,
                            fidelity_prompts=0)
    spec = EngineSpec(kind="pocketllm", model=model, model_path=str(checkpoint.path), threads=args.threads,
                      max_seqs=SEQUENCES, max_len=PREFILL_TOKENS + NEW_TOKENS + 16, backend="cpp")
    engine = PocketEngine(spec)
    samples: dict[str, dict[str, list[float]]] = {isa: {"prefill": [], "e2e": [], "decode": []} for isa in ISAS}
    tokens: dict[str, list[list[int]]] = {}
    try:
        for run in range(args.warmup + args.runs):
            for isa in ISAS if run % 2 == 0 else ISAS[::-1]:  # neither path always goes first
                kernels.set_isa(isa)
                started = time.perf_counter()
                engine.generate([prompts.prefill], 1)
                prefill_s = time.perf_counter() - started
                started = time.perf_counter()
                timings = engine.stream(prompts.prompts, NEW_TOKENS)
                e2e_s = time.perf_counter() - started
                tokens[isa] = engine.generate(prompts.prompts[:2], 16)
                if run < args.warmup:
                    continue
                decoded = sum(t.num_tokens - 1 for t in timings)
                span = max(t.last_token_s for t in timings) - max(t.first_token_s for t in timings)
                samples[isa]["prefill"].append(PREFILL_TOKENS / prefill_s)
                samples[isa]["e2e"].append(SEQUENCES * NEW_TOKENS / e2e_s)
                samples[isa]["decode"].append(decoded / max(span, 1e-9))
    finally:
        kernels.set_isa("auto")
    row: dict = {"model": model, "file": checkpoint.path.name,
                 "storage_types": sorted({t.storage_type for t in checkpoint.tensors()}),
                 "same_tokens": tokens["avx512"] == tokens["amx"]}
    for figure in ("prefill", "e2e", "decode"):
        for isa in ISAS:
            row[f"{figure}_{isa}"] = statistics.median(samples[isa][figure])
            row[f"{figure}_{isa}_range"] = [min(samples[isa][figure]), max(samples[isa][figure])]
        row[f"{figure}_ratio"] = row[f"{figure}_amx"] / row[f"{figure}_avx512"]
    return row


def report(rows: list[dict], meta: dict) -> str:
    lines = [f"# PocketLLM bench: AMX tiles against AVX-512, {meta['date']}, {meta['machine']}", "",
             f"Machine: {host_line(meta['host'])}. One cpp engine per model, {meta['threads']} threads; the "
             "kernels' ISA switched between measurements (avx512 and amx run by run, in turn first); medians of "
             f"{meta['runs']} runs after {meta['warmup']} warm-up. Prefill: one {PREFILL_TOKENS}-token prompt. "
             f"Batch: {SEQUENCES} x ({PROMPT_TOKENS} in + {NEW_TOKENS} out), streamed; AMX takes products of 64 or "
             f"more activation rows, so its decode steps ({SEQUENCES} rows) run the AVX-512 kernels under both "
             "names.", "",
             "| model | tensor types | prefill avx512 tok/s | prefill amx | ratio | batch e2e avx512 | batch e2e amx "
             "| ratio | decode-only avx512 | decode-only amx | ratio | same tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        cells = [row["file"], ", ".join(row["storage_types"])]
        for figure in ("prefill", "e2e", "decode"):
            cells += [f"{row[f'{figure}_avx512']:.0f}", f"{row[f'{figure}_amx']:.0f}", f"{row[f'{figure}_ratio']:.2f}x"]
        cells.append("yes" if row["same_tokens"] else "NO")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=[DEFAULT_MODEL])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    p.add_argument("--machine", default=machine_name())
    return p


def main() -> None:
    args = parser().parse_args()
    if "amx" not in kernels.available_isas().split():
        raise SystemExit(f"this CPU or build has no AMX (available: {kernels.available_isas()})")
    meta = {"date": datetime.date.today().isoformat(), "machine": args.machine, "host": describe(),
            "threads": args.threads, "runs": args.runs, "warmup": args.warmup,
            "load_average_before": os.getloadavg()}
    rows = [measure(model, args) for model in args.models]
    meta["load_average_after"] = os.getloadavg()
    write_tables(args.out, f"{meta['date']}-{args.machine}-amx", report(rows, meta), meta, rows)


if __name__ == "__main__":
    main()
