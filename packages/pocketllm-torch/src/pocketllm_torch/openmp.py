"""torch imported with its OpenMP threads told to sleep as soon as a parallel region ends, without leaving that
choice in the process's environment.

OpenMP's threads are torch's intra-op pool, which oneDNN, MKL and the native kernels use too. libgomp's default
spins for 300,000 iterations before it sleeps: beside other busy processes a spinning thread holds the CPU that the
thread it waits for needs, and a 32-token chat reply of the default model with 2 threads on 2 busy CPUs took 9-15
times as long as with one thread; sleeping at once, 0.3-1.1 times (bench/results/2026-12-02-*-contention.md).

libgomp reads OMP_WAIT_POLICY once, as it loads with torch: the variable is set for that import and removed after
it. Left in ``os.environ``, every process this one starts would inherit it, a user's as much as the bench's peer
engines (llama.cpp's OpenMP threads, told to sleep between its many small parallel regions, decoded Qwen3.5 at half
its speed). Where torch was imported first, or the environment already chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT),
nothing changes.
"""

from __future__ import annotations

import os
import sys


def import_torch() -> None:
    """Import torch (once), its OpenMP waiting passively unless the process chose otherwise."""
    if "torch" in sys.modules or {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
        import torch
        return
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["OMP_WAIT_POLICY"]
