"""The Ascend backend as the core sees it: a probe, a description and an engine factory.

The engine is the torch backend's (``pocketllm_torch.engine.TorchEngine``) with this package's device layer
(``platform.NpuPlatform``): the same scheduler, paged KV cache, models, sampler, prefix caching and state snapshots,
on ``npu`` devices. This module is imported at plugin discovery: torch and torch_npu are imported only in
``create_engine`` and ``run_tp_worker``.
"""

from __future__ import annotations

import glob
import importlib.util
import os
from typing import TYPE_CHECKING

from pocketllm.backend import API_VERSION, FLOAT_STORAGE_TYPES, SAMPLING_OPTIONS, Capabilities
from pocketllm.errors import UnsupportedOptionError
from pocketllm.pooling import POOLING_TYPES
from pocketllm_ascend.name import NAME
from pocketllm_torch.backend import ARCHITECTURES
from pocketllm_torch.options import TorchOptions

if TYPE_CHECKING:
    from collections.abc import Callable

    from pocketllm.args import EngineArgs
    from pocketllm.checkpoint import Checkpoint
    from pocketllm_ascend.platform import NpuPlatform
    from pocketllm_torch.engine import TorchEngine

# Where CANN's set_env.sh points (ASCEND_HOME_PATH; ASCEND_TOOLKIT_HOME in older toolkits), and its default place.
_CANN_VARIABLES = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
_CANN_DEFAULT = "/usr/local/Ascend/ascend-toolkit/latest"
_VISIBLE_VARIABLE = "ASCEND_RT_VISIBLE_DEVICES"
# GGUF's quantized matrices are dequantized at load on NPUs (no grouped kernel there yet): the types that the
# stand-in tests load (the kit's GGUF checkpoint).
QUANTIZED_STORAGE_TYPES = ("Q4_0", "Q4_1", "Q8_0")


class AscendBackend:
    name = NAME
    api_version = API_VERSION

    def probe(self) -> int:
        # From files and the environment, without importing torch_npu (seconds; it initialises the device).
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        return 25  # an accelerator this process has to itself: ahead of the CPU engines

    def capabilities(self) -> Capabilities:
        # Only what the stand-in device's tests exercise (tests/ascend); nothing here has run on Ascend hardware.
        return Capabilities(
            architectures=ARCHITECTURES,
            storage_types=(*FLOAT_STORAGE_TYPES, *QUANTIZED_STORAGE_TYPES),
            sampling_options=SAMPLING_OPTIONS,
            prefix_caching=True,
            structured_outputs=True,
            pooling_types=POOLING_TYPES,
            tensor_parallel=True,
            speculative_methods=("ngram",),
            devices=("npu",),
            dtypes=("float32", "bfloat16", "float16"),
            kv_cache_dtypes=("auto", "float32", "bfloat16", "float16"),
            backend_options=TorchOptions,
        )

    def create_engine(self, args: EngineArgs, checkpoint: Checkpoint, options: TorchOptions) -> TorchEngine:
        platform = _load_platform()
        from pocketllm_torch.engine import TorchEngine

        return TorchEngine(args, checkpoint, options, platform)

    def run_tp_worker(self, args: EngineArgs, checkpoint: Checkpoint, options: TorchOptions,
                      ready: Callable[[], None]) -> None:
        platform = _load_platform()
        from pocketllm_torch.engine import serve_as_worker

        serve_as_worker(args, checkpoint, options, ready, platform)


def unavailable() -> str | None:
    """Why this machine cannot run the backend, from cheap facts; None when it may."""
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu is not installed (install the torch_npu wheel that matches CANN and torch: see README)"
    if not any(os.path.isdir(os.environ.get(v, "")) for v in _CANN_VARIABLES) and not os.path.isdir(_CANN_DEFAULT):
        return (f"CANN runtime not found: neither {' nor '.join(_CANN_VARIABLES)} names a toolkit (source the "
                f"toolkit's set_env.sh) nor is there one at {_CANN_DEFAULT}")
    if os.environ.get(_VISIBLE_VARIABLE, "0").strip() in ("", "-1") or not glob.glob("/dev/davinci[0-9]*"):
        return f"no NPU visible (no /dev/davinci* device, or {_VISIBLE_VARIABLE} hides them all)"
    return None


def _load_platform() -> NpuPlatform:
    """torch, then torch_npu (which adds the npu device to it), then the device layer over them."""
    from pocketllm_torch.openmp import import_torch

    import_torch()
    try:
        import torch_npu  # noqa: F401
    except ImportError as e:
        raise UnsupportedOptionError("device", NAME, f"torch_npu cannot be imported: {e}") from e
    from pocketllm_ascend.platform import NpuPlatform

    return NpuPlatform()
