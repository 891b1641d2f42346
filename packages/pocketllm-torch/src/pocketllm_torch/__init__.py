"""PocketLLM's PyTorch backend: paged KV cache, continuous batching and on-device sampling for Llama-family models.

Importing this package is cheap: torch is only imported when an engine is probed or created.

Before torch loads, OpenMP's threads (torch's intra-op pool, which oneDNN, MKL and the native kernels use too) are
told to sleep as soon as a parallel region ends, unless the environment already chose (OMP_WAIT_POLICY or
GOMP_SPINCOUNT). libgomp's default spins for 300,000 iterations first: beside other busy processes a spinning
thread holds the CPU that the thread it waits for needs, and a 32-token chat reply of the default model with 2
threads on 2 busy CPUs took 9-15 times as long as with one thread; sleeping at once, 0.3-1.1 times
(bench/results/2026-12-02-*-contention.md). Where torch was imported first, its OpenMP keeps the policy it
started with.
"""

import os

if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
