"""The model registry: each architecture name (the checkpoint's model_type) and the class that runs it.

Classes are named by module path so that the backend's plugin module can list the architectures without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

MODELS = {
    "llama": "llama:LlamaModel",
    "qwen3": "qwen3:Qwen3Model",
    "qwen3_5_text": "qwen3_5:Qwen3_5Model",
    "qwen3_5_moe_text": "qwen3_5:Qwen3_5Model",
}


def model_class(architecture: str) -> Any:
    module, name = MODELS[architecture].split(":")
    return getattr(importlib.import_module(f"pocketllm_torch.models.{module}"), name)
