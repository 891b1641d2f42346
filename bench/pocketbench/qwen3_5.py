"""Qwen3.5 side by side: llama.cpp (llama-cpp-python, flash attention), the torch backend and PocketLLM cpp on the same
Q4_K_M GGUF, the same prompt token ids and 2 threads each, in one run.

    python -m pocketbench.qwen3_5 [--models dense moe] [--layers N] [--runs 5] [--new-tokens 128]
        [--requests 32] [--prefix 2048] [--models-dir DIR] [--out results/]

Models (qwen3_5_models.py): random weights in the configuration of Qwen3.5-0.8B (dense) and of Qwen3.5-35B-A3B
scaled to this machine (MoE), converted by llama.cpp's converter and quantized to Q4_K_M by llama-quantize's library
function; ``--layers`` cuts the layer count for a shorter run. Workloads, as ``pocketllm bench`` times them
(workloads.py): a 512-token prefill, single-stream decode, 16 concurrent sequences (end to end and decode only);
the shared-prefix workload (prefix_sharing.py); peak RSS. Beside them, decode's fraction of the memory-bandwidth
bound: the bytes of weights a decoded token reads (every matrix but the embedding table, of which one row is read;
of the experts, the routed share) over the read bandwidth measured in the same run with the same threads. A backend
that cannot serve the file (the core's own check, as ``LLM`` runs it) is reported unsupported, with the reason, and
not measured. Writes ``<date>-<machine>-qwen3_5-<model>.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

from pocketbench import prefix_sharing, runner
from pocketbench.config import BenchConfig, Sizes
from pocketbench.machine import machine_name
from pocketbench.profile import read_bandwidth
from pocketbench.qwen3_5_models import MODELS, ModelSpec, gguf_file
from pocketbench.report import markdown
from pocketbench.results import BenchResults
from pocketbench.workloads import Figure
from pocketllm.args import EngineArgs
from pocketllm.capability_checks import check_engine_args
from pocketllm.checkpoint import Checkpoint, load_checkpoint
from pocketllm.errors import UnsupportedOptionError
from pocketllm.plugins import BackendRegistry
from pocketllm.testing import checkpoints

BACKENDS = ("cpp", "torch")
BOUND = Figure("decode_bound_fraction", "single-stream decode / memory-bandwidth bound", "fraction", True)


def refusal(backend: str, checkpoint: Checkpoint, *, prefix_caching: bool = False) -> str | None:
    """Why ``backend`` cannot serve ``checkpoint`` (with prefix caching), or None where it can."""
    registry = BackendRegistry(allow={backend})
    if backend not in registry.names():
        return "not installed"
    args = EngineArgs(model=str(checkpoint.path), backend=backend, enable_prefix_caching=prefix_caching)
    try:
        check_engine_args(backend, registry.get(backend).capabilities(), args, checkpoint)
    except UnsupportedOptionError as e:
        return str(e)
    return None


def bytes_per_token(checkpoint: Checkpoint) -> int:
    """Bytes of weights one decoded token reads: every matrix but the embedding table (one row; the whole table
    where it is the tied output projection), stacked experts by the routed share, norms and vectors included."""
    extra = checkpoint.config.extra
    routed = extra.get("num_experts_per_tok", 1) / extra.get("num_experts", 1)
    total = 0.0
    for t in checkpoint.tensors():
        if t.name == "model.embed_tokens.weight" and not checkpoint.config.tie_word_embeddings:
            total += t.nbytes / t.shape[0]
        else:
            total += t.nbytes * (routed if ".mlp.experts." in t.name else 1)
    return int(total)


def measure(spec: ModelSpec, args: argparse.Namespace) -> tuple[BenchResults, str]:
    """Every figure of one model, and the report's notes on it."""
    path = gguf_file(spec, args.models_dir)
    checkpoint = load_checkpoint(str(path))
    unsupported = {b: why for b in BACKENDS if (why := refusal(b, checkpoint))}
    backends = tuple(b for b in BACKENDS if b not in unsupported)
    bandwidth = read_bandwidth(args.threads)
    sizes = Sizes(prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, concurrency=(args.concurrency,))
    config = BenchConfig(model=str(path), backends=backends, peers=("llama.cpp",), dtype="auto",
                         threads=args.threads, runs=args.runs, warmup=args.warmup,
                         workloads=("prefill", "decode", "batch"), sizes=sizes, quick=False, out_dir=args.out,
                         machine=args.machine)
    results = runner.run(config)
    prefix = prefix_sharing.PrefixSizes(args.requests, args.prefix, args.question, args.shared_new_tokens)
    caching = [s for s in runner.engine_specs(config, checkpoint.path)
               if s.backend is None or refusal(s.backend, checkpoint, prefix_caching=True) is None]
    prefix_sharing.run(prefix_sharing.specs_for(caching, prefix), prefix, runs=args.runs, warmup=args.warmup,
                       token_range=len(checkpoints._vocab()), log_dir=Path(results.meta["worker_logs"]),
                       results=results)
    per_token = bytes_per_token(checkpoint)
    results.figures.insert(next(i + 1 for i, f in enumerate(results.figures) if f.key == "decode_tok_s"), BOUND)
    for label in results.engines:
        if (decode := results.summary("decode_tok_s", label)) is not None:
            results.values.setdefault(BOUND.key, {})[label] = [decode.median * per_token / bandwidth]
    for backend, why in unsupported.items():
        results.engines[f"pocketllm-{backend}"] = {"unsupported": why}
    if "cpp" in backends and "torch" in backends:  # the "vs the torch backend on the same file" ratio
        results.baselines.append(("pocketllm-cpp", "pocketllm-torch"))
    types = sorted({t.storage_type for t in checkpoint.tensors()})
    results.meta |= {"load_average_after": os.getloadavg(), "model_config": spec.config,
                     "file_bytes": path.stat().st_size, "storage_types": types,
                     "bandwidth_bytes_s": bandwidth, "weight_bytes_per_token": per_token,
                     "shared_prefix": dataclasses.asdict(prefix)}
    notes = (f"Model: random weights, `{spec.name}` configuration ({json.dumps(spec.config)}), converted by "
             "llama.cpp's convert_hf_to_gguf.py and quantized to Q4_K_M by llama_model_quantize: "
             f"{path.stat().st_size / 2**20:.0f} MiB, tensors stored as {', '.join(types)}. Decode bound: "
             f"{per_token / 1e6:.0f} MB of weights read per token over {bandwidth / 1e9:.1f} GB/s read bandwidth "
             f"({args.threads} threads, numpy, measured before the engines loaded): {bandwidth / per_token:.1f} tok/s.")
    return results, notes


def write(results: BenchResults, notes: str, name: str, out: Path) -> Path:
    report = f"{markdown(results)}\n{notes}\n"
    print(report)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"{results.meta['date']}-{results.meta['machine']}-{name}"
    stem.with_suffix(".md").write_text(report)
    results.write_json(stem.with_suffix(".json"))
    return stem.with_suffix(".md")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--layers", type=int, default=None, help="layers of each model (default: its configuration's)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt of the decode and concurrent workloads")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens of the decode and concurrent workloads")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=32, help="requests of the shared-prefix workload")
    p.add_argument("--prefix", type=int, default=2048, help="shared prompt tokens of those requests")
    p.add_argument("--question", type=int, default=64, help="prompt tokens of each request's own")
    p.add_argument("--shared-new-tokens", type=int, default=32, help="tokens each of those requests generates")
    p.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "pocketbench-qwen3_5",
                   help="where the GGUF files are made and kept (default: %(default)s)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    p.add_argument("--machine", default=machine_name())
    return p


def main() -> None:
    args = parser().parse_args()
    for kind in args.models:
        spec = MODELS[kind].with_layers(args.layers)
        results, notes = measure(spec, args)
        print(f"wrote {write(results, notes, f'qwen3_5-{kind}', args.out)}")


if __name__ == "__main__":
    main()

