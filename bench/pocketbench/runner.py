"""One bench run: start the workers (and servers), check fidelity, time the workloads interleaved, write the results."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from tqdm import tqdm

from pocketbench import startup
from pocketbench.config import BASELINE_SUFFIX, BenchConfig, EngineSpec
from pocketbench.fidelity import FidelityCase
from pocketbench.machine import describe
from pocketbench.plot import plot_batch_scaling
from pocketbench.prompts import PromptSet, build_prompts
from pocketbench.report import markdown
from pocketbench.results import BenchResults
from pocketbench.server import ServerTarget
from pocketbench.workers import Worker
from pocketbench.workloads import RSS, Measurement, plan
from pocketllm.checkpoint import load_checkpoint


class Target(Protocol):
    """What the runner times: a worker process, or a server process with its HTTP clients (``server``)."""

    label: str
    info: dict[str, Any]

    def call(self, op: str, **arguments: Any) -> dict[str, Any]: ...

    def close(self) -> None: ...


def _common(config: BenchConfig, model_path: Path) -> dict[str, Any]:
    return {"model": config.model, "model_path": str(model_path), "threads": config.threads,
            "max_seqs": config.sizes.max_seqs, "max_len": config.sizes.max_len}


def engine_specs(config: BenchConfig, model_path: Path) -> list[EngineSpec]:
    """The engines of every workload but serve (startup spawns its own); none when serve is the only one."""
    if not set(config.workloads) - {"serve"}:
        return []
    common = _common(config, model_path)
    return [*(EngineSpec(kind="pocketllm", backend=b, dtype=config.dtype, source=source, **common)
              for b in config.backends for source in _sources(config)),
            *(EngineSpec(kind=peer, **common) for peer in config.peers)]


def serving_specs(config: BenchConfig, model_path: Path) -> list[EngineSpec]:
    """The library (AsyncLLM) worker of each backend for the serve workload; its server copies its settings."""
    if "serve" not in config.workloads:
        return []
    common = _common(config, model_path)
    return [EngineSpec(kind="pocketllm-async", backend=b, dtype=config.dtype, source=source, **common)
            for b in config.backends for source in _sources(config)]


def _sources(config: BenchConfig) -> list[str | None]:
    """Where each backend's engines import PocketLLM from: ours, and with --baseline that version too."""
    return [None] + ([str(config.baseline)] if config.baseline is not None else [])


def run(config: BenchConfig) -> BenchResults:
    checkpoint = load_checkpoint(config.model)
    sizes = config.sizes
    prompts = build_prompts(checkpoint, prefill_tokens=sizes.prefill_tokens, prompt_tokens=sizes.prompt_tokens,
                            count=sizes.max_seqs, fidelity_prompts=sizes.fidelity_prompts)
    specs = engine_specs(config, checkpoint.path)
    serve_specs = serving_specs(config, checkpoint.path)
    log_dir = Path(tempfile.mkdtemp(prefix="pocketbench-"))
    results = BenchResults(
        meta={"date": datetime.date.today().isoformat(), "machine": config.machine, "host": describe(),
              "model": config.model, "model_file": checkpoint.path.name, "threads": config.threads, "runs": config.runs,
              "warmup": config.warmup, "quick": config.quick, "sizes": dataclasses.asdict(sizes),
              "worker_logs": str(log_dir), "load_average_before": os.getloadavg()},
        engines={}, ours=[s.label for s in specs if s.kind == "pocketllm" and not s.source],
        peers=[s.label for s in specs if s.kind != "pocketllm"])
    if config.baseline is not None:
        results.meta["baseline"] = str(config.baseline)
    with contextlib.ExitStack() as stack:
        workers, serving = _load(stack, specs, serve_specs, log_dir)
        for target in (*workers, *serving):
            results.engines[target.label] = target.info
        results.serving = [(library.label, http.label) for library, http in zip(serving[::2], serving[1::2],
                                                                                 strict=True)]
        labels = [target.label for target in (*workers, *serving)]
        results.baselines = [(label, label + BASELINE_SUFFIX) for label in labels if label + BASELINE_SUFFIX in labels]
        if "fidelity" in config.workloads:
            results.fidelity = _fidelity(workers, prompts, sizes.fidelity_tokens)
        if "startup" in config.workloads:
            _startup(config, specs, prompts, log_dir, results)
        _timed(config, workers, serving, prompts, results)
        for target in (*workers, *serving):
            results.values.setdefault(RSS.key, {})[target.label] = [target.call("rss")["peak_rss_mb"]]
        results.figures.append(RSS)
    results.meta["load_average_after"] = os.getloadavg()
    return results


def _load(stack: contextlib.ExitStack, specs: list[EngineSpec], serve_specs: list[EngineSpec],
          log_dir: Path) -> tuple[list[Worker], list[Target]]:
    """Start the engine workers, then per backend the serve workload's library worker and its server."""
    workers: list[Worker] = []
    serving: list[Target] = []  # library, HTTP, library, HTTP ...
    with tqdm(total=len(specs) + 2 * len(serve_specs), desc="loading engines", unit="engine") as bar:
        for spec in specs:
            workers.append(_closing(stack, Worker(spec, log_dir)))
            bar.update()
        for spec in serve_specs:
            library = _closing(stack, Worker(spec, log_dir))
            bar.update()
            serving += [library, _closing(stack, ServerTarget(spec, library.info["backend_options"], log_dir))]
            bar.update()
    return workers, serving


T = TypeVar("T", bound=Target)


def _closing(stack: contextlib.ExitStack, target: T) -> T:
    stack.callback(target.close)
    return target


def _fidelity(workers: list[Worker], prompts: PromptSet, tokens: int) -> list[FidelityCase]:
    cases = []
    for question, ids in tqdm(prompts.fidelity, desc="fidelity", unit="prompt"):
        outputs = {w.spec.label: w.call("generate", prompts=[ids], max_tokens=tokens)["token_ids"][0]
                   for w in workers}
        cases.append(FidelityCase(question, ids, outputs))
    return cases


def _startup(config: BenchConfig, specs: list[EngineSpec], prompts: PromptSet, log_dir: Path,
             results: BenchResults) -> None:
    """Fresh processes, interleaved engine by engine, each with a cold then a warm page cache."""
    prompt = prompts.fidelity[0][1]
    results.figures.extend((startup.COLD, startup.WARM))
    rounds = config.warmup + config.runs
    with tqdm(total=len(specs) * 2 * rounds, desc="startup", unit="start") as bar:
        for i in range(rounds):
            for spec in specs:
                for figure in (startup.COLD, startup.WARM):
                    reply = startup.start_once(spec, log_dir, prompt, cold=figure is startup.COLD)
                    if i >= config.warmup:
                        results.record(figure.key, spec.label, reply, {figure.key: reply["seconds"]})
                    bar.update()


def _timed(config: BenchConfig, workers: list[Worker], serving: list[Target], prompts: PromptSet,
           results: BenchResults) -> None:
    measurements = plan(config.workloads, config.sizes, prompts)
    rounds = config.warmup + config.runs

    def targets(m: Measurement) -> Sequence[Target]:
        return serving if m.op == "serve" else workers

    with tqdm(total=sum(len(targets(m)) for m in measurements) * rounds, desc="measuring", unit="run") as bar:
        for m in measurements:
            results.figures.extend(m.figures)
            for i in range(rounds):
                for target in targets(m):  # A B C A B C ...: drift of the machine hits every engine alike
                    bar.set_postfix_str(f"{m.key}, {target.label}, {'warm-up' if i < config.warmup else i}")
                    reply = target.call(m.op, prompts=m.prompts, max_tokens=m.max_tokens)
                    values = m.values(reply)
                    if i >= config.warmup:
                        results.record(m.key, target.label, reply, values)
                    bar.update()


def write(results: BenchResults, config: BenchConfig) -> list[Path]:
    """Write the markdown, JSON and PNG files; returns their paths."""
    config.out_dir.mkdir(parents=True, exist_ok=True)
    stem = config.out_dir / f"{results.meta['date']}-{config.machine}{'-quick' if config.quick else ''}"
    paths = [stem.with_suffix(".md"), stem.with_suffix(".json")]
    paths[0].write_text(markdown(results))
    results.write_json(paths[1])
    if any(f.key.startswith("batch") for f in results.figures):
        paths.append(stem.with_suffix(".png"))
        plot_batch_scaling(results, config.sizes.concurrency, paths[2])
    return paths
