"""The cpp backend's options (``--backend-options``), as the core validates them: imported at plugin discovery,
so nothing here loads the native module."""

from __future__ import annotations

from typing import Annotated

import msgspec

from pocketllm.backend_options import BackendOptions
from pocketllm.limits import MAX_THREADS


class CppOptions(BackendOptions, kw_only=True):
    block_size: Annotated[int, msgspec.Meta(
        ge=1, description="tokens per KV-cache block, at most max_model_len")] = 16
    exact_activations: Annotated[bool, msgspec.Meta(
        description="multiply float32 activations, not 8-bit ones with integer dot products (llama.cpp's way)")] = False
    num_kv_blocks: Annotated[int, msgspec.Meta(
        ge=1, description="KV-cache blocks; by default every sequence at full length, within a quarter of "
                          "RAM")] | None = None
    num_threads: Annotated[int, msgspec.Meta(
        ge=1, le=MAX_THREADS, description="worker threads; by default one per CPU this process may use (its "
                                          "affinity and cgroup quota)")] | None = None
    state_snapshot_mb: Annotated[int, msgspec.Meta(
        ge=1, le=1 << 30, description="memory for prefix-cache snapshots of hybrid models' state layers, in MiB "
                                      "(Qwen3.5-9B: ~50 MB each)")] = 512
