"""The NPU as the torch backend's engine uses it (``pocketllm_torch.platform.Platform``), through ``torch.npu``
(torch_npu's device module) and HCCL.

Seeded sampling draws its noise on the CPU (``noise_device``) and copies it over: a seed then gives the same tokens
on an NPU as on the torch backend on CPU, and the noise costs one vocabulary row per seeded request and step.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from pocketllm_ascend.fused_ops import NpuFusedOps
from pocketllm_ascend.name import NAME
from pocketllm_torch.platform import Platform


class NpuPlatform(Platform):
    device_type: ClassVar[str] = "npu"
    collective_backend: ClassVar[str] = "hccl"
    backend_name: ClassVar[str] = NAME

    def __init__(self) -> None:
        self._fused = NpuFusedOps()

    def fused_ops(self) -> NpuFusedOps:
        return self._fused

    def noise_device(self, device: torch.device) -> torch.device:
        return torch.device("cpu")
