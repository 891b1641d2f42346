"""One bench run: start the workers, check fidelity, time the workloads interleaved, write the results."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import tempfile
from pathlib import Path

from tqdm import tqdm

from pocketbench.config import BenchConfig, EngineSpec
from pocketbench.fidelity import FidelityCase
from pocketbench.machine import describe
from pocketbench.plot import plot_batch_scaling
from pocketbench.prompts import PromptSet, build_prompts
from pocketbench.report import markdown
from pocketbench.results import BenchResults
from pocketbench.workers import Worker
from pocketbench.workloads import RSS, plan
from pocketllm.checkpoint import load_checkpoint


def engine_specs(config: BenchConfig, model_path: Path) -> list[EngineSpec]:
    common = {"model": config.model, "model_path": str(model_path), "threads": config.threads,
              "max_seqs": config.sizes.max_seqs, "max_len": config.sizes.max_len}
    return [*(EngineSpec(kind="pocketllm", backend=b, dtype=config.dtype, **common) for b in config.backends),
            *(EngineSpec(kind=peer, **common) for peer in config.peers)]


def run(config: BenchConfig) -> BenchResults:
    checkpoint = load_checkpoint(config.model)
    sizes = config.sizes
    prompts = build_prompts(checkpoint, prefill_tokens=sizes.prefill_tokens, prompt_tokens=sizes.prompt_tokens,
                            count=sizes.max_seqs, fidelity_prompts=sizes.fidelity_prompts)
    specs = engine_specs(config, checkpoint.path)
    log_dir = Path(tempfile.mkdtemp(prefix="pocketbench-"))
    results = BenchResults(
        meta={"date": datetime.date.today().isoformat(), "machine": config.machine, "host": describe(),
              "model": config.model, "model_file": checkpoint.path.name, "threads": config.threads, "runs": config.runs,
              "warmup": config.warmup, "quick": config.quick, "sizes": dataclasses.asdict(sizes),
              "worker_logs": str(log_dir), "load_average_before": os.getloadavg()},
        engines={}, ours=[s.label for s in specs if s.kind == "pocketllm"],
        peers=[s.label for s in specs if s.kind != "pocketllm"])
    with contextlib.ExitStack() as stack:
        workers = []
        for spec in tqdm(specs, desc="loading engines", unit="engine"):
            worker = Worker(spec, log_dir)
            stack.callback(worker.close)
            workers.append(worker)
            results.engines[spec.label] = worker.info
        if "fidelity" in config.workloads:
            results.fidelity = _fidelity(workers, prompts, sizes.fidelity_tokens)
        _timed(config, workers, prompts, results)
        for worker in workers:
            results.values.setdefault(RSS.key, {})[worker.spec.label] = [worker.call("rss")["peak_rss_mb"]]
        results.figures.append(RSS)
    results.meta["load_average_after"] = os.getloadavg()
    return results


def _fidelity(workers: list[Worker], prompts: PromptSet, tokens: int) -> list[FidelityCase]:
    cases = []
    for question, ids in tqdm(prompts.fidelity, desc="fidelity", unit="prompt"):
        outputs = {w.spec.label: w.call("generate", prompts=[ids], max_tokens=tokens)["token_ids"][0]
                   for w in workers}
        cases.append(FidelityCase(question, ids, outputs))
    return cases


def _timed(config: BenchConfig, workers: list[Worker], prompts: PromptSet, results: BenchResults) -> None:
    measurements = plan(config.workloads, config.sizes, prompts)
    rounds = config.warmup + config.runs
    with tqdm(total=len(measurements) * rounds * len(workers), desc="measuring", unit="run") as bar:
        for m in measurements:
            results.figures.extend(m.figures)
            for i in range(rounds):
                for worker in workers:  # A B C A B C ...: drift of the machine hits every engine alike
                    bar.set_postfix_str(f"{m.key}, {worker.spec.label}, {'warm-up' if i < config.warmup else i}")
                    reply = worker.call(m.op, prompts=m.prompts, max_tokens=m.max_tokens)
                    values = m.values(reply)
                    if i >= config.warmup:
                        results.record(m.key, worker.spec.label, reply, values)
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
