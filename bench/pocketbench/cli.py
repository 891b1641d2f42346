"""The ``pocketllm bench`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pocketbench.config import (
    FULL,
    KNOWN_BACKENDS,
    PEERS,
    QUICK,
    SERVE_TARGET_CLIENTS,
    SERVE_TARGET_RATIO,
    WORKLOADS,
    BenchConfig,
)
from pocketbench.machine import machine_name
from pocketbench.report import markdown
from pocketllm.args import DEFAULT_MODEL
from pocketllm.plugins import BackendRegistry

DESCRIPTION = """\
Run the same workloads on PocketLLM backends and on peer engines (llama.cpp through llama-cpp-python,
transformers generate()) in one run, on the same model, prompt token ids and thread count, and report
PocketLLM/peer ratios. Each engine runs in its own worker process that loads the model once; runs are
interleaved engine by engine (A B C A B C ...). Every figure is the median, min and max of --runs measured
runs after --warmup warm-up runs. Greedy decoding, EOS ignored, so every sequence produces exactly the
requested number of tokens.

Peers are bench-only dependencies: `nox -s bench` installs them (llama-cpp-python, transformers with
accelerate, matplotlib, tqdm, psutil, and httpx for the serve workload's clients)."""

EPILOG = f"""\
workloads (--workloads; all by default):
  startup   a fresh worker process per run, from spawn to its first token (interpreter, imports, model load,
            one greedy token on a chat prompt), with a cold page cache (dropped where permitted, else the
            model file evicted) and a warm one, interleaved engine by engine; seconds.
  prefill   one {FULL.prefill_tokens}-token prompt, 1 new token; tok/s = {FULL.prefill_tokens} / wall time.
  decode    one {FULL.prompt_tokens}-token prompt, {FULL.new_tokens} new tokens, streamed; tok/s =
            ({FULL.new_tokens} - 1) / (time of last token - time of first token): prefill excluded.
  batch     for each N in --concurrency ({' '.join(map(str, FULL.concurrency))}): N different \
{FULL.prompt_tokens}-token prompts submitted
            at once, {FULL.new_tokens} new tokens each, streamed; end to end tok/s = N x {FULL.new_tokens} / wall \
time (prefill included), and decode only = tokens after each sequence's first / (last token of any -
            the moment every sequence has its first token).
            Also plotted: aggregate tok/s against N, one line per engine.
  ttft      {FULL.ttft_requests} {FULL.prompt_tokens}-token requests submitted at once ({FULL.ttft_new_tokens} new \
tokens each); p50 and p99 over
            the requests of each run of the time from a request's submission to its first token, in ms.
  serve     for each N in --serve-concurrency ({' '.join(map(str, FULL.serve_concurrency))}): N streaming \
clients send {FULL.prompt_tokens}-token prompts
            at once, {FULL.new_tokens} new tokens each, to a pocketllm-server process over HTTP (/v1/completions,
            token-id prompt, stream: true, ignore_eos, temperature 0; httpx clients in the bench process),
            and the same requests to AsyncLLM in a worker process, runs interleaved (library, HTTP, ...),
            same model, backend, dtype, KV sizing and threads. Per side: aggregate tok/s = tokens
            streamed / (last token of any request - first send), and TTFT p50, p99 (send -> first streamed
            token) in ms; HTTP / library ratios. Target: HTTP >= {SERVE_TARGET_RATIO:.0%} of library tok/s \
at {SERVE_TARGET_CLIENTS} clients.
            PocketLLM backends only; needs pocketllm-server.
  fidelity  the first {FULL.fidelity_tokens} greedy token ids of each engine for {FULL.fidelity_prompts} chat \
prompts (the same ids
            for every engine, rendered with PocketLLM's chat template); flags the first position where
            each PocketLLM backend differs from each peer. Runs once, untimed.
  peak RSS  always: VmHWM of each engine's worker process at the end of the run (load included);
            VmHWM for the serve workload's server processes.

--quick shrinks every workload ({QUICK.prefill_tokens}-token prefill, {QUICK.prompt_tokens}-token prompts, \
{QUICK.new_tokens} new tokens, concurrency
{' '.join(map(str, QUICK.concurrency))}, {QUICK.ttft_requests} TTFT requests, serve clients \
{' '.join(map(str, QUICK.serve_concurrency))}, 1 fidelity prompt of {QUICK.fidelity_tokens} tokens) and
defaults to 1 measured run, for smoke tests; its files are suffixed -quick. With serve as the only
workload, no LLM or peer worker is started.

output: a markdown table (printed, and written to OUT/<date>-<machine>.md), every raw figure in
OUT/<date>-<machine>.json, and the batch plot in OUT/<date>-<machine>.png."""


def at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pocketllm bench", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="model alias, .gguf file or safetensors directory "
                        "(llama.cpp needs a GGUF; default: %(default)s)")
    parser.add_argument("--backend", action="append", dest="backends", metavar="NAME",
                        help="PocketLLM backend to measure; repeat for several (default: each installed one of "
                             f"{', '.join(KNOWN_BACKENDS)})")
    parser.add_argument("--dtype", default="auto", help="PocketLLM dtype (default: %(default)s, the backend's choice)")
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=list(PEERS),
                        help=f"peer engines (default: {' '.join(PEERS)}; none: --peers)")
    parser.add_argument("--threads", type=at_least(1), default=2,
                        help="threads of every engine (default: %(default)s)")
    parser.add_argument("--runs", type=at_least(1), default=None,
                        help="measured runs per figure (default: 5; 1 with --quick)")
    parser.add_argument("--warmup", type=at_least(0), default=1, help="unmeasured runs first (default: %(default)s)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS), metavar="W",
                        help=f"workloads to run, from {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--concurrency", nargs="+", type=at_least(1), default=None, metavar="N",
                        help="sequence counts of the batch workload (default: "
                             f"{' '.join(map(str, FULL.concurrency))})")
    parser.add_argument("--serve-concurrency", nargs="+", type=at_least(1), default=None, metavar="N",
                        help="client counts of the serve workload (default: "
                             f"{' '.join(map(str, FULL.serve_concurrency))})")
    parser.add_argument("--quick", action="store_true", help="small workloads and 1 run, for smoke tests")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results",
                        help="directory for the result files (default: bench/results)")
    parser.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                        help="also run each PocketLLM engine (library, AsyncLLM, server) from another version's "
                             "packages: DIR holds pocketllm, pocketllm_server and the backends' packages (with their "
                             "compiled modules), e.g. an older checkout's; adds this/baseline ratios")
    parser.add_argument("--machine", default=machine_name(),
                        help="machine name in the result file names (default: %(default)s)")
    return parser


def config_from(ns: argparse.Namespace, installed: list[str]) -> BenchConfig:
    sizes = QUICK if ns.quick else FULL
    if ns.concurrency:
        sizes = dataclasses.replace(sizes, concurrency=tuple(ns.concurrency))
    if ns.serve_concurrency:
        sizes = dataclasses.replace(sizes, serve_concurrency=tuple(ns.serve_concurrency))
    if "serve" in ns.workloads and importlib.util.find_spec("pocketllm_server") is None:
        raise SystemExit("the serve workload needs pocketllm-server (pip install pocketllm[server]); "
                         "or leave it out with --workloads")
    if ns.baseline is not None and not (ns.baseline / "pocketllm").is_dir():
        raise SystemExit(f"--baseline {ns.baseline} holds no pocketllm package")
    backends = tuple(ns.backends or [b for b in KNOWN_BACKENDS if b in installed])
    if not backends:
        raise SystemExit(f"no PocketLLM backend to measure: none of {', '.join(KNOWN_BACKENDS)} is installed")
    return BenchConfig(model=ns.model, backends=backends, peers=tuple(ns.peers), dtype=ns.dtype, threads=ns.threads,
                       runs=ns.runs or (1 if ns.quick else 5), warmup=ns.warmup, workloads=tuple(ns.workloads),
                       sizes=sizes, quick=ns.quick, out_dir=ns.out, machine=ns.machine, baseline=ns.baseline)


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    config = config_from(ns, BackendRegistry().names())
    from pocketbench.runner import run, write  # needs the bench-only packages, which --help does not

    results = run(config)
    print(markdown(results))
    for path in write(results, config):
        print(f"wrote {path}", file=sys.stderr)
    return 0
