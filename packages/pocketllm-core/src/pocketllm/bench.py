"""``pocketllm bench``: find the benchmark harness of a PocketLLM checkout and run it.

The harness (``bench/pocketbench`` in the repository) ships in no distribution, since it drives peer engines
that are never product dependencies; ``nox -s bench`` installs those. It is looked up in
``$POCKETLLM_BENCH_DIR``, then in the current directory and its parents, then above this file (editable installs),
and runs as ``python -m pocketbench`` in a process of its own, with that directory on its ``PYTHONPATH``: the core
never imports it, and relative paths in the arguments mean what they meant where the command was typed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

BENCH_DIR_ENV = "POCKETLLM_BENCH_DIR"
HARNESS = "pocketbench"


def find_bench_dir() -> Path | None:
    """The directory holding the harness package, or None."""
    if BENCH_DIR_ENV in os.environ:
        candidates = [Path(os.environ[BENCH_DIR_ENV])]
    else:
        starts = (Path.cwd(), Path(__file__).resolve().parent)
        candidates = [folder / "bench" for start in starts for folder in (start, *start.parents)]
    return next((c for c in candidates if (c / HARNESS / "__main__.py").is_file()), None)


def main(argv: Sequence[str]) -> int:
    bench_dir = find_bench_dir()
    if bench_dir is None:
        print(f"error: `pocketllm bench` runs from a PocketLLM checkout: run it inside the repository, or set "
              f"{BENCH_DIR_ENV} to its bench/ directory", file=sys.stderr)
        return 2
    path = os.pathsep.join(filter(None, [str(bench_dir.resolve()), os.environ.get("PYTHONPATH")]))
    harness = subprocess.Popen([sys.executable, "-m", HARNESS, *argv], env={**os.environ, "PYTHONPATH": path})
    while True:
        try:
            return harness.wait()
        except KeyboardInterrupt:  # the harness had the same Ctrl-C: it stops its workers and exits in its own time
            continue
