"""The device layer: what the engine asks of the device it runs on, so that the rest of the backend is
device-generic (no ``if device == "cuda"`` outside this module).

A ``Platform`` answers for one torch device type: how a device name resolves, the dtype "auto" means there, the
memory the KV cache may take, how a rank binds to its device, the collective backend of its tensors, where seeded
sampling draws its noise, and the fused operators (``fused_ops.FusedOps``) that replace groups of torch ops there.
The CPU and CUDA platforms are here; a backend plugin for another device (pocketllm-ascend's NPU) passes its own
to ``TorchEngine``, which activates it for the process (``activate``). Nothing here synchronises a device: the
engine's only waits are its reads of results (``tolist``), which wait for the device.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from pocketllm.errors import UnsupportedOptionError
from pocketllm_torch.name import NAME

if TYPE_CHECKING:
    from pocketllm_torch.fused_ops import FusedOps

CPU_KV_MEMORY_FRACTION = 0.25  # of physical RAM: the weights and the rest of the process need the remainder
DEVICE_KV_MEMORY_FRACTION = 0.9  # of an accelerator's memory still free once the weights are loaded


class Platform:
    """One device type, as the engine uses it. Subclasses override what differs from an accelerator with its own
    memory (the defaults below are CUDA's shape, answered through ``torch.<device_type>``)."""

    device_type: ClassVar[str]
    collective_backend: ClassVar[str]  # torch.distributed's backend for this device's tensors
    # Whether the tensor-parallel ranks on one machine share its memory (CPUs) or each has a device of its own.
    ranks_share_memory: ClassVar[bool] = False
    # Whether decode steps replay TorchScript traces by default: where a small model's decode is bound by
    # Python overhead and the device has no graphs of its own (see decode_graphs.py).
    traces_decode: ClassVar[bool] = False
    backend_name: ClassVar[str] = NAME  # the backend its refusals name

    def resolve(self, name: str) -> torch.device:
        """The device ``name`` ("cuda", "npu:1") means, refusing one that is not there. Without an index it stays
        the current device of its type (a tensor-parallel rank names its own: see config.py)."""
        device, module = torch.device(name), self._module()
        if not module.is_available():
            raise UnsupportedOptionError("device", self.backend_name, f"no {self.device_type} device is available")
        if device.index is not None and device.index >= module.device_count():
            raise UnsupportedOptionError("device", self.backend_name, f"{name} is not among the "
                                         f"{module.device_count()} {self.device_type} devices")
        return device

    def auto_dtype(self) -> torch.dtype:
        """What ``dtype="auto"`` means: bf16 on accelerators."""
        return torch.bfloat16

    def supports_float16(self) -> bool:
        return True

    def bind(self, index: int) -> None:
        """Make device ``index`` this process's current one (a tensor-parallel rank's: its local rank's)."""
        self._module().set_device(index)

    def process_group_backend(self) -> str:
        """torch.distributed's backend string: the step messages are CPU tensors (gloo), activations this
        device's collective backend."""
        return f"cpu:gloo,{self.device_type}:{self.collective_backend}"

    def physical_memory(self, device: torch.device) -> int:
        return int(self._module().get_device_properties(device).total_memory)

    def kv_memory_budget(self, device: torch.device) -> int:
        """Bytes the KV cache (and state slots and snapshots) may take, measured once the weights are loaded."""
        free, _ = self._module().mem_get_info(device)
        return int(free * DEVICE_KV_MEMORY_FRACTION)

    def release_cache(self) -> None:
        """Return the caching allocator's free blocks to the device (at engine shutdown)."""
        self._module().empty_cache()

    def fused_ops(self) -> FusedOps | None:
        """The fused operators of this device, or None: the torch ops (and Triton's kernels where they run)."""
        return None

    def noise_device(self, device: torch.device) -> torch.device:
        """Where the sampler draws a seeded row's noise (a torch.Generator there): the device itself."""
        return device

    def _module(self) -> Any:  # torch.cuda, torch.npu, ...: modules without a common type
        return getattr(torch, self.device_type)


class CpuPlatform(Platform):
    device_type = "cpu"
    collective_backend = "gloo"
    ranks_share_memory = True
    traces_decode = True

    def resolve(self, name: str) -> torch.device:
        return torch.device(name)

    def auto_dtype(self) -> torch.dtype:
        # Decode streams every weight once per step, so half-size weights are nearly twice as fast wherever
        # torch has vectorised bf16 kernels (see linear.py for CPUs without bf16 matrix instructions).
        if torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512", "AMX")):
            return torch.bfloat16
        return torch.float32

    def supports_float16(self) -> bool:
        return False

    def bind(self, index: int) -> None:
        del index  # one CPU device; tensor-parallel ranks share its cores (tensor_parallel.Group divides them)

    def process_group_backend(self) -> str:
        return "gloo"

    def physical_memory(self, device: torch.device) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def kv_memory_budget(self, device: torch.device) -> int:
        return int(self.physical_memory(device) * CPU_KV_MEMORY_FRACTION)

    def release_cache(self) -> None:
        pass  # freed tensors go straight back to the allocator


class CudaPlatform(Platform):
    device_type = "cuda"
    collective_backend = "nccl"


BUILT_IN: dict[str, Platform] = {"cpu": CpuPlatform(), "cuda": CudaPlatform()}
# The platform of each device type in this process: the built-in ones, and a plugin's once its engine starts.
_ACTIVE: dict[str, Platform] = dict(BUILT_IN)


# The fused operators of the active platforms that have them: empty on CPUs and CUDA, where a lookup then costs a
# truth test (fused_ops.for_tensor runs several times per layer).
FUSED: dict[str, FusedOps] = {}


def activate(platform: Platform) -> None:
    """Make ``platform`` the one that answers for tensors on its device type (``of``): at engine start."""
    _ACTIVE[platform.device_type] = platform
    ops = platform.fused_ops()
    if ops is not None:
        FUSED[platform.device_type] = ops
    else:
        FUSED.pop(platform.device_type, None)


def of(device: torch.device) -> Platform | None:
    """The platform of a tensor's device, for code that has the tensor but not the engine (the sampler)."""
    return _ACTIVE.get(device.type)


def for_device_name(name: str) -> Platform:
    """This backend's own platform for a device name ("auto": CUDA where it is available, else the CPU)."""
    if name == "auto":
        return BUILT_IN["cuda" if torch.cuda.is_available() else "cpu"]
    kind = torch.device(name).type
    if kind not in BUILT_IN:
        raise UnsupportedOptionError("device", NAME, f"{name!r}: this backend runs on {', '.join(BUILT_IN)}")
    return BUILT_IN[kind]
