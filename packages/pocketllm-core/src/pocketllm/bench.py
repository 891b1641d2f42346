"""``pocketllm bench``: find the benchmark harness of a PocketLLM checkout and run it.

The harness (``bench/pocketbench`` in the repository) ships in no distribution, since it drives peer engines
that are never product dependencies; ``nox -s bench`` installs those. It is looked up in
``$POCKETLLM_BENCH_DIR``, then in the current directory and its parents, then above this file (editable installs).
"""

from __future__ import annotations

import importlib
import os
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
    return next((c for c in candidates if (c / HARNESS / "__init__.py").is_file()), None)


def main(argv: Sequence[str]) -> int:
    bench_dir = find_bench_dir()
    if bench_dir is None:
        print(f"error: `pocketllm bench` runs from a PocketLLM checkout: run it inside the repository, or set "
              f"{BENCH_DIR_ENV} to its bench/ directory", file=sys.stderr)
        return 2
    sys.path.insert(0, str(bench_dir))
    return importlib.import_module(f"{HARNESS}.cli").main(argv)
