"""Two builds of the cpp backend side by side, idle and beside busy processes.

    python -m pocketbench.builds --baseline DIR [--threads default 1] [--burners 0 2] \\
        [--workloads prefill decode batch forward] [--new-tokens 128] [--runs 5] [--out results/] [--name N]

DIR holds another build's ``pocketllm_cpp`` package (its Python files and ``_native`` module: e.g. a copy of
``packages/pocketllm-cpp/src/pocketllm_cpp`` with the extension built from an older commit); the installed package
is the other side. Each (build, thread setting) is a worker process that loads the model once; ``default`` leaves
the thread count to the backend. Per condition (idle, or N busy Python loops: the CPU contention of a shared host or
a container's quota), every run visits the engines in turn, so machine drift hits all alike; one warm-up, then
--runs measured runs: medians, min and max. The workloads are ``pocketllm bench``'s (prefill of 512 tokens; decode
after a 128-token prompt; batch: 8 prompts at once, end to end and decode only), and ``forward``: the model's
forward pass alone on one thread (no thread option: the kernels' cost), timed by the CPU time of the thread that
runs it, the least of 20 tries: tokens per CPU second of a 512-token prefill, of one decode step after 128 tokens,
and of one step of 8 such sequences. Where other work shares the machine (CI, a shared host), wall times vary
several-fold from run to run, and CPU time far less. Ratios: this build over the
baseline per thread setting, and default threads over 1 thread per build (the contention check: a pool that spins
while one of its workers is descheduled collapses there). Prints a table, writes
``<date>-<machine>-builds[-NAME].{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pocketbench.config import Sizes
from pocketbench.contention import busy_processes
from pocketbench.engines.pocket import PocketEngine
from pocketbench.machine import write_report
from pocketbench.prompts import PromptSet, build_prompts
from pocketbench.protocol import read_message, write_message
from pocketbench.stats import Summary
from pocketbench.worker import handle
from pocketbench.workers import HARNESS_ROOT, WorkerError, tail
from pocketbench.workloads import Figure, Measurement, plan
from pocketllm import LLM
from pocketllm.args import DEFAULT_MODEL
from pocketllm.checkpoint import load_checkpoint

BUILDS = ("baseline", "this")
WORKLOADS = ("prefill", "decode", "batch", "forward")
BATCH = 8
FORWARD_TRIES = 20
FORWARD_FIGURES = (Figure("forward_prefill_tok_cpu_s", "forward, 512-token prefill, 1 thread", "tok/CPU s", True),
                   Figure("forward_decode_tok_cpu_s", "forward, decode step after 128 tokens, 1 thread",
                          "tok/CPU s", True),
                   Figure("forward_batch_tok_cpu_s", f"forward, decode step of {BATCH} x 128 tokens, 1 thread",
                          "tok/CPU s", True))


@dataclasses.dataclass(frozen=True)
class Side:
    build: str  # one of BUILDS
    threads: int | None  # None: the backend's default

    @property
    def label(self) -> str:
        if self.threads is None:
            return f"{self.build}, default threads"
        return f"{self.build}, {self.threads} thread{'s' if self.threads > 1 else ''}"


class BuildEngine(PocketEngine):
    """The cpp backend through ``LLM``, with the backend's own thread count unless one is given (PocketEngine's
    setup always sets one, so its constructor is not used)."""

    def __init__(self, model: str, threads: int | None, sizes: Sizes) -> None:
        options = {} if threads is None else {"num_threads": threads}
        self.llm = LLM(model, backend="cpp", max_model_len=sizes.max_len, max_num_seqs=sizes.max_seqs,
                       backend_options=options, show_progress=False)

    def info(self) -> dict[str, Any]:
        import pocketllm_cpp

        return {"package": str(Path(pocketllm_cpp.__file__).parent),
                "threads": getattr(self.llm.backend_engine, "num_threads", None)}


@dataclasses.dataclass(frozen=True)
class ForwardMeasurement(Measurement):
    """The ``forward`` workload: its reply is its figures (a prefill prompt, then BATCH decode prompts)."""

    def values(self, reply: dict[str, Any]) -> dict[str, float]:
        return dict(zip((f.key for f in self.figures), reply["tok_cpu_s"], strict=True))


def forward_measurement(prompts: PromptSet) -> ForwardMeasurement:
    return ForwardMeasurement("forward", "forward", [prompts.prefill, *prompts.prompts[:BATCH]], 1, FORWARD_FIGURES,
                              lambda reply: reply["tok_cpu_s"])


def forward_rates(model: Any, prompts: list[list[int]]) -> list[float]:
    """Tokens per CPU second of the calling thread (the model has one thread: all the work is here)."""
    block = 16
    tables = [list(range(i * 64, i * 64 + 64)) for i in range(BATCH + 1)]  # 1024 positions each
    prefill, contexts = prompts[0], prompts[1:]

    def least(run: Any) -> float:
        best = float("inf")
        for _ in range(FORWARD_TRIES):
            start = time.thread_time()
            run()
            best = min(best, time.thread_time() - start)
        return best

    assert len(prefill) <= 64 * block
    seconds = least(lambda: model.forward(prefill, [(0, len(prefill), tables[BATCH], True)]))
    for i, prompt in enumerate(contexts):
        model.forward(prompt, [(0, len(prompt), tables[i], True)])
    step = [(len(p), 1, tables[i], True) for i, p in enumerate(contexts)]
    one = least(lambda: model.forward([5], step[:1]))
    batch = least(lambda: model.forward([5] * len(step), step))
    return [len(prefill) / seconds, 1 / one, len(step) / batch]


class BuildWorker:
    """One side's engine in its own process (``python -m pocketbench.builds --worker ...``)."""

    def __init__(self, side: Side, baseline: Path, model: str, sizes: Sizes, log_dir: Path) -> None:
        self.side = side
        self.log_path = log_dir / f"builds-{side.build}-{side.threads or 'default'}.log"
        path = [str(HARNESS_ROOT), str(baseline) if side.build == "baseline" else "", os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
        command = [sys.executable, "-m", "pocketbench.builds", "--worker", model, str(side.threads or "default"),
                   str(sizes.new_tokens)]
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                            text=True, env=env)
        self.info = self._reply()

    def call(self, measurement: Measurement) -> dict[str, Any]:
        assert self.process.stdin is not None
        write_message(self.process.stdin, {"op": measurement.op, "prompts": measurement.prompts,
                                           "max_tokens": measurement.max_tokens})
        return self._reply()

    def _reply(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        message = read_message(self.process.stdout)
        if message is None or not message["ok"]:
            detail = tail(self.log_path) if message is None else message["error"]
            raise WorkerError(f"{self.side.label} worker failed; log: {self.log_path}\n{detail}")
        return message["result"]

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


def sizes_for(new_tokens: int) -> Sizes:
    return Sizes(new_tokens=new_tokens, concurrency=(BATCH,), ttft_requests=1, serve_concurrency=(1,))


def condition_name(burners: int) -> str:
    return "idle" if burners == 0 else f"{burners} busy processes"


def ratios(summaries: dict[str, Summary], sides: list[Side]) -> dict[str, float]:
    """Median ratios: this build / baseline per thread setting, default / 1 thread per build."""
    out = {}
    by = {(s.build, s.threads): summaries[s.label].median for s in sides if s.label in summaries}
    for threads in dict.fromkeys(s.threads for s in sides):
        if ("this", threads) in by and ("baseline", threads) in by:
            name = Side("this", threads).label.removeprefix("this, ")
            out[f"this / baseline, {name}"] = by[("this", threads)] / by[("baseline", threads)]
    for build in BUILDS:
        if (build, None) in by and (build, 1) in by:
            out[f"default / 1 thread, {build}"] = by[(build, None)] / by[(build, 1)]
    return out


def report(values: dict[str, dict[str, dict[str, list[float]]]], measurements: list[Measurement],
           sides: list[Side], title: str) -> tuple[str, dict[str, Any]]:
    """The markdown table and the JSON figures: per condition and figure, each side's median (min-max), ratios."""
    figures = {f.key: f for m in measurements for f in m.figures}
    summaries: dict[str, dict[str, dict[str, Summary]]] = {}
    ratio_table: dict[str, dict[str, dict[str, float]]] = {}
    names: list[str] = []
    for condition, by_figure in values.items():
        for key, by_label in by_figure.items():
            summary = {label: Summary.of(runs) for label, runs in by_label.items()}
            summaries.setdefault(condition, {})[key] = summary
            found = ratios(summary, sides)
            ratio_table.setdefault(condition, {})[key] = found
            names.extend(name for name in found if name not in names)
    lines = [f"# {title}", "", "| condition | figure | " + " | ".join(s.label for s in sides) + " | "
             + " | ".join(names) + " |", "|---" * (2 + len(sides) + len(names)) + "|"]
    for condition, by_figure in summaries.items():
        for key, summary in by_figure.items():
            figure = figures[key]
            cells = [f"{s.median:.1f} ({s.min:.1f}-{s.max:.1f})" if (s := summary.get(side.label)) else "-"
                     for side in sides]
            found = ratio_table[condition][key]
            lines.append(f"| {condition} | {figure.label}, {figure.unit} | " + " | ".join(cells) + " | "
                         + " | ".join(f"{found[n]:.3f}" if n in found else "-" for n in names) + " |")
    data = {"values": values, "ratios": ratio_table,
            "summaries": {c: {k: {label: dataclasses.asdict(s) for label, s in by.items()} for k, by in f.items()}
                          for c, f in summaries.items()}}
    return "\n".join(lines) + "\n", data


def run(args: argparse.Namespace) -> None:
    sizes = sizes_for(args.new_tokens)
    prompts = build_prompts(load_checkpoint(args.model), prefill_tokens=sizes.prefill_tokens,
                            prompt_tokens=sizes.prompt_tokens, count=BATCH, fidelity_prompts=0)
    measurements = plan(tuple(args.workloads), sizes, prompts)
    if "forward" in args.workloads:
        measurements.append(forward_measurement(prompts))
    sides = [Side(build, threads) for threads in args.threads for build in BUILDS]
    args.out.mkdir(parents=True, exist_ok=True)
    workers = [BuildWorker(side, args.baseline, args.model, sizes, args.out) for side in sides]
    values: dict[str, dict[str, dict[str, list[float]]]] = {}
    try:
        for burners in args.burners:
            with busy_processes(burners):
                for number in range(args.warmup + args.runs):
                    for worker in workers:
                        for measurement in measurements:
                            figures = measurement.values(worker.call(measurement))
                            if number < args.warmup:
                                continue
                            for key, value in figures.items():
                                values.setdefault(condition_name(burners), {}).setdefault(key, {}).setdefault(
                                    worker.side.label, []).append(value)
    finally:
        for worker in workers:
            worker.close()
    title = (f"cpp backend builds side by side: {args.model}, {os.cpu_count()} CPUs, baseline {args.baseline}, "
             f"{args.runs} runs")
    text, data = report(values, measurements, sides, title)
    figures = {"model": args.model, "baseline": str(args.baseline), "engines": {w.side.label: w.info for w in workers},
               **data}
    write_report(args.out, "-".join(filter(None, ["builds", args.name])), text, figures)


def worker_main(model: str, threads: str, new_tokens: str) -> None:
    """The child side: load the engine, answer a ready message, then serve pocketbench.worker requests."""
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # C libraries print to fd 1 too
    engine = BuildEngine(model, None if threads == "default" else int(threads), sizes_for(int(new_tokens)))
    write_message(channel, {"ok": True, "result": engine.info()})
    alone = None  # the forward workload's one-thread model, built when first asked for
    while (request := read_message(sys.stdin)) is not None:
        if request["op"] == "forward":
            from pocketllm_cpp.model import build_model

            alone = alone or build_model(load_checkpoint(model), num_blocks=64 * (BATCH + 1), block_size=16,
                                         num_threads=1)
            write_message(channel, {"ok": True, "result": {"tok_cpu_s": forward_rates(alone, request["prompts"])}})
            continue
        write_message(channel, {"ok": True, "result": handle(engine, request)})
    os._exit(0)  # skip interpreter teardown, as pocketbench.worker does


def thread_setting(text: str) -> int | None:
    return None if text == "default" else int(text)


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker_main(*sys.argv[2:5])
    parser = argparse.ArgumentParser(description="two builds of the cpp backend side by side")
    parser.add_argument("--baseline", type=Path, required=True, help="a directory holding the other pocketllm_cpp")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--threads", type=thread_setting, nargs="+", default=[None, 1],
                        help="thread settings: 'default' (the backend's) or a count (default: default 1)")
    parser.add_argument("--burners", type=int, nargs="+", default=[0, 2],
                        help="busy processes beside the engines, one condition each (default: 0 2)")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per sequence of decode and batch")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    parser.add_argument("--name", default="", help="suffix of the result files: <date>-<machine>-builds-NAME")
    args = parser.parse_args()
    if not (args.baseline / "pocketllm_cpp").is_dir():
        parser.error(f"{args.baseline} holds no pocketllm_cpp package")
    run(args)


if __name__ == "__main__":
    main()
