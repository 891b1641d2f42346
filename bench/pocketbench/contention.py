"""The torch backend's intra-op threads beside busy processes: default threads against one, and OpenMP's waiting.

    python -m pocketbench.contention [--model smollm2-135m-instruct] [--burners 0 2] [--runs 5] [--out results/]

Per side, a worker process that loads the model once (torch backend, default dtype) and times a 32-token greedy
chat reply (EOS ignored), as the issue's reproducer did. Sides: the backend's defaults (threads: the CPUs the
process may use; OpenMP threads sleep once a parallel region ends, see pocketllm_torch/__init__.py), the same
threads with libgomp's own waiting (``GOMP_SPINCOUNT=300000``: spin that long first, what torch did before), and
``num_threads`` 1 with either. Per condition (the machine as it is, or N busy Python loops beside the workers:
a shared host, a container's quota), every run visits the sides in turn, so drift hits all alike; one warm-up,
then --runs measured runs: median, min and max seconds, and each side over the backend's defaults at 1 thread.
The load average before each condition is kept, since an idle figure is only as idle as the machine was. Prints
a table and writes ``<date>-<machine>-contention.{md,json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pocketbench.machine import write_report
from pocketbench.protocol import read_message, write_message
from pocketbench.stats import Summary
from pocketbench.workers import HARNESS_ROOT, WorkerError, tail
from pocketllm.args import DEFAULT_MODEL

QUESTION = "What is the capital of France?"
TOKENS = 32
SPIN = {"GOMP_SPINCOUNT": "300000"}  # libgomp's default spin when OMP_WAIT_POLICY is unset


@dataclasses.dataclass(frozen=True)
class Side:
    label: str
    threads: int | None  # None: the backend's default
    env: dict[str, str]


SIDES = (Side("default threads", None, {}), Side("default threads, libgomp spin", None, SPIN),
         Side("1 thread", 1, {}), Side("1 thread, libgomp spin", 1, SPIN))
REFERENCE = "1 thread"


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` Python processes spinning at 100 % of a CPU each, for the duration."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()


def condition_name(burners: int) -> str:
    return "as is" if burners == 0 else f"{burners} busy processes"


class Worker:
    """One side's engine in its own process (``python -m pocketbench.contention --worker ...``)."""

    def __init__(self, side: Side, model: str, log_dir: Path) -> None:
        self.side = side
        self.log_path = log_dir / f"contention-{side.label.replace(' ', '-').replace(',', '')}.log"
        # The side's waiting, and nothing inherited that would choose it instead.
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env |= side.env | {"PYTHONPATH": os.pathsep.join(filter(None, [str(HARNESS_ROOT), env.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "pocketbench.contention", "--worker", model, str(side.threads or "default")]
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                            text=True, env=env)
        self.info = self.call({"op": "info"})

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        write_message(self.process.stdin, request)
        message = read_message(self.process.stdout)
        if message is None or not message["ok"]:
            detail = tail(self.log_path) if message is None else message["error"]
            raise WorkerError(f"{self.side.label} worker failed; log: {self.log_path}\n{detail}")
        return message["result"]

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.wait()


def report(values: dict[str, dict[str, list[float]]], loads: dict[str, float], title: str) -> tuple[str, dict]:
    summaries = {c: {label: Summary.of(runs) for label, runs in by.items()} for c, by in values.items()}
    lines = [f"# {title}", "", f"Seconds for a {TOKENS}-token greedy chat reply; ratio: over {REFERENCE} in the "
             "same condition.", "", "| condition (load average before) | " + " | ".join(s.label for s in SIDES)
             + " |", "|---" * (1 + len(SIDES)) + "|"]
    ratios: dict[str, dict[str, float]] = {}
    for condition, by in summaries.items():
        reference = by[REFERENCE].median
        ratios[condition] = {label: s.median / reference for label, s in by.items()}
        cells = [f"{by[s.label].median:.2f} ({by[s.label].min:.2f}-{by[s.label].max:.2f}), "
                 f"{ratios[condition][s.label]:.2f}x" for s in SIDES]
        lines.append(f"| {condition} ({loads[condition]:.1f}) | " + " | ".join(cells) + " |")
    data = {"values": values, "load_average": loads, "ratios": ratios,
            "summaries": {c: {k: dataclasses.asdict(s) for k, s in by.items()} for c, by in summaries.items()}}
    return "\n".join(lines) + "\n", data


def run(args: argparse.Namespace) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    workers = [Worker(side, args.model, args.out) for side in SIDES]
    values: dict[str, dict[str, list[float]]] = {}
    loads: dict[str, float] = {}
    try:
        for burners in args.burners:
            condition = condition_name(burners)
            loads[condition] = os.getloadavg()[0]
            with busy_processes(burners):
                for number in range(args.warmup + args.runs):
                    for worker in workers:
                        seconds = worker.call({"op": "chat"})["seconds"]
                        if number >= args.warmup:
                            values.setdefault(condition, {}).setdefault(worker.side.label, []).append(seconds)
    finally:
        for worker in workers:
            worker.close()
    title = f"torch backend threads beside busy processes: {args.model}, {os.cpu_count()} CPUs, {args.runs} runs"
    text, data = report(values, loads, title)
    write_report(args.out, "contention", text, {"model": args.model, "tokens": TOKENS,
                                                "engines": {w.side.label: w.info for w in workers}, **data})


def worker_main(model: str, threads: str) -> None:
    """The child side: load the engine, then answer ``info`` and ``chat`` requests."""
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # C libraries print to fd 1 too
    from pocketllm import LLM, SamplingParams

    options = {} if threads == "default" else {"num_threads": int(threads)}
    llm = LLM(model, backend="torch", backend_options=options, show_progress=False)
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
    messages = [{"role": "user", "content": QUESTION}]
    while (request := read_message(sys.stdin)) is not None:
        if request["op"] == "info":
            import torch

            result: dict[str, Any] = {"threads": torch.get_num_threads(), "dtype": str(llm.backend_engine.config.dtype),
                                      **{k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}}
        else:
            started = time.perf_counter()
            [out] = llm.chat(messages, params)
            result = {"seconds": time.perf_counter() - started, "tokens": len(out.outputs[0].token_ids)}
        write_message(channel, {"ok": True, "result": result})
    os._exit(0)  # skip interpreter teardown, as pocketbench.worker does


def main() -> None:
    if sys.argv[1:2] == ["--worker"]:
        return worker_main(*sys.argv[2:4])
    parser = argparse.ArgumentParser(description="torch backend threads beside busy processes")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--burners", type=int, nargs="+", default=[0, 2],
                        help="busy processes beside the workers, one condition each (default: 0 2)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "results")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
