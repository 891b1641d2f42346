"""The torch backend's options (``--backend-options``), as the core validates them: imported at plugin discovery,
so nothing here imports torch."""

from __future__ import annotations

from typing import Annotated

import msgspec

from pocketllm.backend_options import BackendOptions
from pocketllm.limits import MAX_THREADS


class TorchOptions(BackendOptions, kw_only=True):
    block_size: Annotated[int, msgspec.Meta(ge=1, description="tokens per KV-cache block")] = 16
    decode_graphs: Annotated[bool, msgspec.Meta(
        description="replay decode steps from TorchScript traces; by default on CPUs, where a small model's "
                    "decode is bound by Python overhead")] | None = None
    num_kv_blocks: Annotated[int, msgspec.Meta(
        ge=1, description="KV-cache blocks; by default every sequence at full length, within a share of the "
                          "memory (a quarter of RAM; 90% of what the weights leave free on a GPU)")] | None = None
    num_threads: Annotated[int, msgspec.Meta(
        ge=1, le=MAX_THREADS, description="torch's intra-op threads; by default the CPUs this process may use, "
                                          "at most torch's own default")] | None = None
    state_snapshot_mb: Annotated[int, msgspec.Meta(
        ge=1, le=1 << 30, description="memory for prefix-cache snapshots of hybrid models' state layers, in MiB "
                                      "(Qwen3.5-9B: ~50 MB each)")] = 512
