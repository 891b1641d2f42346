"""The model registry: each architecture name (the checkpoint's model_type) and the class that runs it.

Classes are named by module path so that the backend's plugin module can list the architectures without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from pocketllm.errors import UnsupportedOptionError
from pocketllm_torch.name import NAME

MODELS = {
    "llama": "llama:LlamaModel",
    "qwen3": "qwen3:Qwen3Model",
    "qwen3_5_text": "qwen3_5:Qwen3_5Model",
    "qwen3_5_moe_text": "qwen3_5:Qwen3_5Model",
}


# Multi-token-prediction heads (speculative_method "mtp"), by the architecture of the model they draft for.
MTP_MODELS = {
    "qwen3_5_text": "qwen3_5_mtp:Qwen3_5MTP",
    "qwen3_5_moe_text": "qwen3_5_mtp:Qwen3_5MTP",
}


def model_class(architecture: str) -> Any:
    return _load(MODELS[architecture])


def mtp_class(architecture: str) -> Any:
    if architecture not in MTP_MODELS:
        raise UnsupportedOptionError("speculative_method", NAME, f"'mtp' has no multi-token-prediction head for "
                                     f"{architecture!r} (it has for {', '.join(MTP_MODELS)})")
    return _load(MTP_MODELS[architecture])


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(f"pocketllm_torch.models.{module}"), name)
