"""The startup workload: a fresh worker process per run, from spawn to its first generated token.

Each run starts the engine's worker (interpreter, imports, model load) and asks it for one greedy token on a
chat prompt, with the page cache either warm (the previous run read everything) or cold: the kernel's page
cache dropped where this process may (root, /proc/sys/vm/drop_caches), else the model file evicted with
posix_fadvise; the JSON says which.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from pocketbench.config import EngineSpec
from pocketbench.workers import Worker
from pocketbench.workloads import Figure

COLD = Figure("startup_cold_s", "start to first token, cold page cache", "s", higher_is_better=False)
WARM = Figure("startup_warm_s", "start to first token, warm page cache", "s", higher_is_better=False)


def evict(model_path: Path) -> str:
    """Make the next start read from disk; returns what was evicted."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return "page cache"
    except OSError:
        pass
    for path in (model_path.rglob("*") if model_path.is_dir() else [model_path]):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return "model file"


def start_once(spec: EngineSpec, log_dir: Path, prompt: list[int], *, cold: bool) -> dict[str, Any]:
    """Spawn, load, generate one token, stop; the seconds to the token and to the loaded engine."""
    evicted = evict(Path(spec.model_path)) if cold else None
    started = time.perf_counter()
    worker = Worker(spec, log_dir)
    loaded = time.perf_counter()
    try:
        reply = worker.call("generate", prompts=[prompt], max_tokens=1)
    finally:
        worker.close()
    if [len(ids) for ids in reply["token_ids"]] != [1]:
        raise RuntimeError(f"{spec.label}: expected one token, got {reply['token_ids']}")
    return {"seconds": loaded - started + reply["seconds"], "spawn_to_loaded_s": loaded - started,
            "first_token_s": reply["seconds"], "engine_load_s": worker.info["load_s"], "evicted": evicted}
