"""The torch backend as the core sees it: a description and an engine factory.

This module is imported at plugin discovery, so torch is only imported inside ``probe`` and ``create_engine``.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from pocketllm.backend import API_VERSION, FLOAT_STORAGE_TYPES, SAMPLING_OPTIONS, Capabilities
from pocketllm.pooling import POOLING_TYPES
from pocketllm_torch.models import MODELS
from pocketllm_torch.name import NAME
from pocketllm_torch.openmp import import_torch
from pocketllm_torch.options import TorchOptions

if TYPE_CHECKING:
    from collections.abc import Callable

    from pocketllm.args import EngineArgs
    from pocketllm.checkpoint import Checkpoint
    from pocketllm_torch.engine import TorchEngine

ARCHITECTURES = tuple(MODELS)
# Every GGUF quantized storage type the gguf package dequantizes (4- and 8-bit groups stay so where a kernel
# reads them), and FP8 safetensors (kept FP8, dequantized a tile at a time).
QUANTIZED_STORAGE_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                           "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
                           "TQ1_0", "TQ2_0", "MXFP4", "F8_E4M3")


class TorchBackend:
    name = NAME
    api_version = API_VERSION

    def probe(self) -> int:
        # Runs anywhere torch does; preferred where it has a GPU to itself. Answered from files, without importing
        # torch (seconds, on every `auto` start even when another backend wins): create_engine imports it, and
        # resolves device "auto" with torch.cuda.is_available() itself.
        return 20 if _gpu_build(_torch_dir()) and _gpu_visible() else 10

    def capabilities(self) -> Capabilities:
        return Capabilities(
            architectures=ARCHITECTURES,
            storage_types=(*FLOAT_STORAGE_TYPES, "F64", *QUANTIZED_STORAGE_TYPES),
            sampling_options=SAMPLING_OPTIONS,
            prefix_caching=True,
            structured_outputs=True,
            pooling_types=POOLING_TYPES,
            tensor_parallel=True,
            speculative_methods=("ngram", "mtp", "draft_model"),
            devices=("cpu", "cuda"),
            dtypes=("float32", "bfloat16", "float16"),
            kv_cache_dtypes=("auto", "float32", "bfloat16", "float16", "fp8"),
            backend_options=TorchOptions,
        )

    def create_engine(self, args: EngineArgs, checkpoint: Checkpoint, options: TorchOptions) -> TorchEngine:
        import_torch()
        from pocketllm_torch.engine import TorchEngine

        return TorchEngine(args, checkpoint, options)

    def run_tp_worker(self, args: EngineArgs, checkpoint: Checkpoint, options: TorchOptions,
                      ready: Callable[[], None]) -> None:
        import_torch()
        from pocketllm_torch.engine import serve_as_worker

        serve_as_worker(args, checkpoint, options, ready)


# torch/version.py records the toolkit a build was made for ("cuda: Optional[str] = '12.4'"; None in a CPU build).
_TOOLKIT = re.compile(r"^(?:cuda|hip)\b[^=\n]*=\s*(\S+)", re.MULTILINE)
# Device nodes of an NVIDIA GPU, of ROCm, and of WSL's GPU passthrough.
_GPU_NODES = ("/dev/nvidia0", "/dev/kfd", "/dev/dxg")


def _torch_dir() -> Path:
    spec = importlib.util.find_spec("torch")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("torch is not installed: pip install torch")
    return Path(next(iter(spec.submodule_search_locations)))


def _gpu_build(torch_dir: Path) -> bool:
    """Whether this torch was built for CUDA or ROCm."""
    try:
        text = (torch_dir / "version.py").read_text(encoding="utf-8")
    except OSError:
        return False
    return any(value != "None" for value in _TOOLKIT.findall(text))


def _gpu_visible() -> bool:
    """Whether this process may see a GPU: a device node, and no CUDA_VISIBLE_DEVICES that hides them all."""
    for variable in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        if os.environ.get(variable, "0").strip() in ("", "-1"):
            return False
    return any(os.path.exists(node) for node in _GPU_NODES)
