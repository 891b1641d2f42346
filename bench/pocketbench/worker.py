"""One engine in its own process: ``python -m pocketbench.worker SPEC_JSON``.

Loads the engine once, answers with a ready message (its info, or the load error), then serves requests
from stdin until stdin closes (see ``protocol``). Anything else written to stdout goes to stderr, the log.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import IO, Any

from pocketbench.config import EngineSpec
from pocketbench.engines import CachingEngine, Engine, ServingEngine, load_engine
from pocketbench.protocol import read_message, write_message


def peak_rss_mb() -> float:
    """This process's peak resident set: VmHWM, not ru_maxrss, which Linux carries over fork and execve from the
    process before (a parent that made the model, or measured bandwidth, in-process lends its peak to every worker)."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # elsewhere the nearest figure (KiB on Linux)


def handle(engine: Engine | ServingEngine, request: dict[str, Any]) -> dict[str, Any]:
    op = request["op"]
    if op == "rss":
        return {"peak_rss_mb": peak_rss_mb()}
    if op == "cache_stats" and isinstance(engine, CachingEngine):
        return dataclasses.asdict(engine.cache_stats())
    prompts, max_tokens = request["prompts"], request["max_tokens"]
    start = time.perf_counter()
    timings: list[Any]
    if op == "generate" and isinstance(engine, Engine):
        token_ids = engine.generate(prompts, max_tokens)
        return {"seconds": time.perf_counter() - start, "token_ids": token_ids}
    if op == "stream" and isinstance(engine, Engine):
        timings = engine.stream(prompts, max_tokens)
    elif op == "serve" and isinstance(engine, ServingEngine):
        timings = engine.serve(prompts, max_tokens)
    else:
        raise ValueError(f"op {op!r} is not one of {type(engine).__name__}'s")
    return {"seconds": time.perf_counter() - start, "timings": [dataclasses.asdict(t) for t in timings]}


def serve(spec: EngineSpec, channel: IO[str]) -> None:
    start = time.perf_counter()
    try:
        engine = load_engine(spec)
    except Exception:
        write_message(channel, {"ok": False, "error": traceback.format_exc()})
        return
    info = {**engine.info(), "load_s": time.perf_counter() - start, "rss_after_load_mb": peak_rss_mb()}
    write_message(channel, {"ok": True, "result": info})
    while (request := read_message(sys.stdin)) is not None:
        try:
            write_message(channel, {"ok": True, "result": handle(engine, request)})
        except Exception:
            write_message(channel, {"ok": False, "error": traceback.format_exc()})


def main() -> None:
    spec = EngineSpec.from_json(json.loads(sys.argv[1]))
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # C libraries print to fd 1 too
    serve(spec, channel)
    os._exit(0)  # skip interpreter teardown: engine threads and native libraries can make it slow


if __name__ == "__main__":
    main()
