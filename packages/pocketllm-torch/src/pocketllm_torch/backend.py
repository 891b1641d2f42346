"""The torch backend as the core sees it: a description and an engine factory.

This module is imported at plugin discovery, so torch is only imported inside ``probe`` and ``create_engine``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pocketllm.backend import API_VERSION, Capabilities

if TYPE_CHECKING:
    from pocketllm.args import EngineArgs
    from pocketllm.checkpoint import Checkpoint
    from pocketllm_torch.engine import TorchEngine

NAME = "torch"
ARCHITECTURES = ("llama", "qwen3")
BACKEND_OPTIONS = ("block_size", "decode_graphs", "num_kv_blocks", "num_threads")
MAX_LOGPROBS = 20


class TorchBackend:
    name = NAME
    api_version = API_VERSION

    def probe(self) -> int:
        import torch

        # Runs anywhere torch does; preferred where it has a GPU to itself.
        return 20 if torch.cuda.is_available() else 10

    def capabilities(self) -> Capabilities:
        return Capabilities(
            batching=True,
            logprobs=True,
            max_logprobs=MAX_LOGPROBS,
            prefix_caching=True,
            tensor_parallel=False,
            speculative_methods=(),
            architectures=ARCHITECTURES,
            devices=("cpu", "cuda"),
            dtypes=("float32", "bfloat16", "float16"),
            kv_cache_dtypes=("auto", "float32", "bfloat16", "float16"),
            backend_options=BACKEND_OPTIONS,
        )

    def create_engine(self, args: EngineArgs, checkpoint: Checkpoint) -> TorchEngine:
        from pocketllm_torch.engine import TorchEngine

        return TorchEngine(args, checkpoint)
