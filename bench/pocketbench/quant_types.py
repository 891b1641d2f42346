"""Each GGUF quantization users download, PocketLLM cpp against llama.cpp on the same files, in one run.

    python -m pocketbench.quant_types [--types Q2_K Q3_K_M Q4_K_M Q5_K_M IQ4_XS Q8_0 Q4_1] [--runs 5]
        [--threads 2] [--new-tokens 128] [--files-dir DIR] [--out results/]

The default model re-quantized by llama-quantize's library function (``llama_model_quantize``, with
``--allow-requantize`` as the tool needs for a quantized source) to each file type: llama.cpp's own mixes, so a
Q2_K or Q3_K_M file also holds the types llama.cpp falls back to where a matrix's 576-wide rows do not divide into
256-value super-blocks (the file's types are listed); Q4_1 is the model's own file. Per file, as ``pocketllm
bench`` times them (workloads.py): a 512-token prefill and single-stream decode, the engines interleaved run by run,
and decode's fraction of the memory-bandwidth bound (the bytes of weights a decoded token reads over the read
bandwidth measured in the same run with the same threads). Writes ``<date>-<machine>-quant-types.{md,json}``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
from pathlib import Path

from pocketbench import runner
from pocketbench.config import BenchConfig, Sizes
from pocketbench.machine import describe, machine_name
from pocketbench.profile import read_bandwidth
from pocketbench.qwen3_5 import bytes_per_token
from pocketbench.qwen3_5_models import made_once, quantize
from pocketbench.report import host_line, write_tables
from pocketllm.args import DEFAULT_MODEL
from pocketllm.checkpoint import load_checkpoint

SHIPPED = "Q4_1"  # the default model's own file, for reference
FILE_TYPES = ("Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "IQ4_XS", "Q8_0", SHIPPED)
OURS, PEER = "pocketllm-cpp", "llama.cpp"
TARGETS = {"decode": 1.3, "prefill": 1.5}  # the ratios over llama.cpp


def requantized(file_type: str, folder: Path) -> Path:
    """The default model re-quantized to ``file_type`` (kept in ``folder`` for the next run), or its own file."""
    source = Path(load_checkpoint(DEFAULT_MODEL).path)
    if file_type == SHIPPED:
        return source

    def make(_: Path, out: Path) -> None:
        quantize(source, out, file_type, requantize=True)

    return made_once(folder / f"{source.stem}-{file_type}.gguf", make)


def measure(file_type: str, args: argparse.Namespace, bandwidth: float) -> dict:
    path = requantized(file_type, args.files_dir)
    checkpoint = load_checkpoint(str(path))
    sizes = Sizes(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, concurrency=(1,))
    config = BenchConfig(model=str(path), backends=("cpp",), peers=(PEER,), dtype="auto", threads=args.threads,
                         runs=args.runs, warmup=args.warmup, workloads=("prefill", "decode"), sizes=sizes,
                         quick=False, out_dir=args.out, machine=args.machine)
    results = runner.run(config)
    per_token = bytes_per_token(checkpoint)
    row: dict = {"file_type": file_type, "file_bytes": path.stat().st_size, "weight_bytes_per_token": per_token,
                 "storage_types": sorted({t.storage_type for t in checkpoint.tensors()}),
                 "bound_tok_s": bandwidth / per_token}
    for workload in TARGETS:
        for label in (OURS, PEER):
            summary = results.summary(f"{workload}_tok_s", label)
            row[f"{workload}_{label}"] = None if summary is None else summary.median
            row[f"{workload}_{label}_range"] = None if summary is None else [summary.min, summary.max]
        ours, theirs = row[f"{workload}_{OURS}"], row[f"{workload}_{PEER}"]
        row[f"{workload}_ratio"] = ours / theirs if ours and theirs else None
    for label in (OURS, PEER):
        decode = row[f"decode_{label}"]
        row[f"bound_fraction_{label}"] = None if decode is None else decode / row["bound_tok_s"]
    return row


def report(rows: list[dict], meta: dict) -> str:
    def number(value: float | None, digits: int = 0) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def ratio(row: dict, workload: str) -> str:
        value = row[f"{workload}_ratio"]
        return "-" if value is None else f"{value:.2f}x {'met' if value >= TARGETS[workload] else 'not met'}"

    lines = [f"# PocketLLM bench: quantization types, {meta['date']}, {meta['machine']}", "",
             f"Machine: {host_line(meta['host'])}. Default model re-quantized by `llama_model_quantize`; "
             f"{meta['threads']} threads per engine, each in its own process; medians of {meta['runs']} runs after "
             f"{meta['warmup']} warm-up, engines interleaved run by run. Read bandwidth "
             f"{meta['bandwidth_bytes_s'] / 1e9:.1f} GB/s "
             f"(numpy, {meta['threads']} threads, measured before the engines loaded). Targets: decode >= "
             f"{TARGETS['decode']}x and prefill >= {TARGETS['prefill']}x llama.cpp.", "",
             "| file type | tensor types | MB read / token | bound tok/s | decode cpp | decode llama.cpp "
             "| decode ratio | cpp / bound | llama.cpp / bound | prefill cpp | prefill llama.cpp | prefill ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(
            f"| {row['file_type']} | {', '.join(row['storage_types'])} | {row['weight_bytes_per_token'] / 1e6:.1f} "
            f"| {number(row['bound_tok_s'])} | {number(row[f'decode_{OURS}'])} | {number(row[f'decode_{PEER}'])} "
            f"| {ratio(row, 'decode')} | {number(row[f'bound_fraction_{OURS}'], 2)} "
            f"| {number(row[f'bound_fraction_{PEER}'], 2)} | {number(row[f'prefill_{OURS}'])} "
            f"| {number(row[f'prefill_{PEER}'])} | {ratio(row, 'prefill')} |")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--types", nargs="+", choices=FILE_TYPES, default=list(FILE_TYPES))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt of the decode workload")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens of the decode workload")
    p.add_argument("--files-dir", type=Path, default=Path(tempfile.gettempdir()) / "pocketbench-quant-types",
                   help="where the re-quantized files are made and kept (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    p.add_argument("--machine", default=machine_name())
    return p


def main() -> None:
    args = parser().parse_args()
    bandwidth = read_bandwidth(args.threads)
    meta = {"date": datetime.date.today().isoformat(), "machine": args.machine, "host": describe(),
            "threads": args.threads, "runs": args.runs, "warmup": args.warmup, "bandwidth_bytes_s": bandwidth,
            "load_average_before": os.getloadavg()}
    rows = [measure(file_type, args, bandwidth) for file_type in args.types]
    meta["load_average_after"] = os.getloadavg()
    write_tables(args.out, f"{meta['date']}-{args.machine}-quant-types", report(rows, meta), meta, rows)


if __name__ == "__main__":
    main()
