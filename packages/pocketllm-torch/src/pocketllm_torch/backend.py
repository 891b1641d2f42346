"""The torch backend as the core sees it: a description and an engine factory.

This module is imported at plugin discovery, so torch is only imported inside ``probe`` and ``create_engine``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pocketllm.backend import API_VERSION, FLOAT_STORAGE_TYPES, SAMPLING_OPTIONS, Capabilities
from pocketllm.pooling import POOLING_TYPES
from pocketllm_torch.models import MODELS

if TYPE_CHECKING:
    from collections.abc import Callable

    from pocketllm.args import EngineArgs
    from pocketllm.checkpoint import Checkpoint
    from pocketllm_torch.engine import TorchEngine

NAME = "torch"
ARCHITECTURES = tuple(MODELS)
BACKEND_OPTIONS = ("block_size", "decode_graphs", "num_kv_blocks", "num_threads", "state_snapshot_mb")
# Every GGUF block type the gguf package dequantizes (4- and 8-bit groups stay so where a kernel reads them).
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M",
               "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ1_0", "TQ2_0", "MXFP4")


class TorchBackend:
    name = NAME
    api_version = API_VERSION

    def probe(self) -> int:
        import torch

        # Runs anywhere torch does; preferred where it has a GPU to itself.
        return 20 if torch.cuda.is_available() else 10

    def capabilities(self) -> Capabilities:
        return Capabilities(
            architectures=ARCHITECTURES,
            quantization_formats=(*FLOAT_STORAGE_TYPES, "F64", *BLOCK_TYPES),
            sampling_options=SAMPLING_OPTIONS,
            prefix_caching=True,
            structured_outputs=True,
            pooling_types=POOLING_TYPES,
            tensor_parallel=True,
            devices=("cpu", "cuda"),
            dtypes=("float32", "bfloat16", "float16"),
            kv_cache_dtypes=("auto", "float32", "bfloat16", "float16"),
            backend_options=BACKEND_OPTIONS,
        )

    def create_engine(self, args: EngineArgs, checkpoint: Checkpoint) -> TorchEngine:
        from pocketllm_torch.engine import TorchEngine

        return TorchEngine(args, checkpoint)

    def run_tp_worker(self, args: EngineArgs, checkpoint: Checkpoint, ready: Callable[[], None]) -> None:
        from pocketllm_torch.engine import serve_as_worker

        serve_as_worker(args, checkpoint, ready)
