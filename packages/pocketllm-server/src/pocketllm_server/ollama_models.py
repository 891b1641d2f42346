"""GET /api/tags, POST /api/show, GET /api/ps and GET /api/version: the one served model as Ollama describes a
model."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pocketllm import AsyncLLM
from pocketllm.checkpoint import load_checkpoint
from pocketllm.model_config import ModelConfig
from pocketllm_server.app_state import ServerState, read_model_request, state_of
from pocketllm_server.ollama_protocol import (
    OLLAMA_VERSION,
    ListedModel,
    ListResponse,
    ModelDetails,
    ProcessResponse,
    RunningModel,
    ShowRequest,
    ShowResponse,
    VersionResponse,
    timestamp,
)
from pocketllm_server.protocol import (
    json_response,
)

# Sampling settings the checkpoint recommends (the server's defaults), by Ollama's names where they differ.
_OLLAMA_NAMES = {"repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}
# Ollama's "forever" (a negative keep_alive): the longest Go duration, which its /api/ps adds to the time now.
_FOREVER_S = (2**63 - 1) / 1e9


async def tags(request: Request) -> Response:
    state = state_of(request)
    facts = await _facts(state.require_llm())
    name = state.served_model_name
    return json_response(ListResponse(models=[ListedModel(name=name, model=name, modified_at=facts.modified_at,
                                                          size=facts.size, digest="", details=facts.details)]))


async def show(request: Request) -> Response:
    state, _, llm = await read_model_request(request, ShowRequest)  # it checked the model's name
    facts = await _facts(llm)
    parameters = [("num_ctx", llm.max_model_len),
                  *((_OLLAMA_NAMES.get(name, name), value) for name, value in sorted(state.sampling_defaults.items()))]
    return json_response(ShowResponse(
        modelfile=_modelfile(llm.checkpoint_path, parameters),
        parameters="\n".join(f"{name:<30} {json.dumps(value)}" for name, value in parameters),
        template=llm.tokenizer.chat_template or "", details=facts.details,
        model_info=_model_info(llm.model_config, facts.parameter_count),
        capabilities=_capabilities(llm, state), modified_at=facts.modified_at))


async def ps(request: Request) -> Response:
    """The loaded model: the served one once it is loaded, which stays loaded while the server runs, as a model
    under Ollama's keep_alive -1 does."""
    state = state_of(request)
    llm = state.llm
    if llm is None:  # still loading, or it failed to
        return json_response(ProcessResponse(models=[]))
    facts = await _facts(llm)
    name = state.served_model_name
    return json_response(ProcessResponse(models=[RunningModel(
        name=name, model=name, size=facts.size, digest="", details=facts.details,
        expires_at=timestamp(time.time() + _FOREVER_S), size_vram=facts.size if _on_accelerator(llm) else 0,
        context_length=llm.max_model_len)]))


async def version(request: Request) -> Response:
    return json_response(VersionResponse(version=OLLAMA_VERSION))


@dataclass(frozen=True, slots=True)
class _Facts:
    details: ModelDetails
    parameter_count: int
    size: int  # bytes of the checkpoint's files
    modified_at: str


async def _facts(llm: AsyncLLM) -> _Facts:
    # Off the event loop: the checkpoint's headers are read (once) to count its parameters.
    return await asyncio.to_thread(_checkpoint_facts, str(llm.checkpoint_path))


@functools.cache
def _checkpoint_facts(path: str) -> _Facts:
    checkpoint = load_checkpoint(path)
    tensors = checkpoint.tensors() + checkpoint.mtp_tensors()
    count = sum(math.prod(t.shape) for t in tensors)
    # A float checkpoint's "quantization" is its matrices' storage type (F16, BF16), as Ollama names it.
    storage = Counter(t.storage_type for t in tensors if len(t.shape) > 1)
    quantization = checkpoint.quantization or (storage.most_common(1)[0][0] if storage else "")
    architecture = checkpoint.config.architecture
    details = ModelDetails(parent_model="", format=checkpoint.format, family=architecture, families=[architecture],
                           parameter_size=_human_count(count), quantization_level=quantization)
    files = [Path(path)] if Path(path).is_file() else [f for f in Path(path).rglob("*") if f.is_file()]
    return _Facts(details=details, parameter_count=count, size=sum(f.stat().st_size for f in files),
                  modified_at=timestamp(max(f.stat().st_mtime for f in files)))


def _on_accelerator(llm: AsyncLLM) -> bool:
    """Whether the weights are in an accelerator's memory: on a device named so, or on a backend that runs on no
    other. Device "auto" on a backend that also runs on the CPU (torch) counts as the CPU: the engine does not say
    what it resolved "auto" to."""
    device = llm.args.device.split(":")[0]
    return "cpu" not in llm.capabilities.devices if device == "auto" else device != "cpu"


def _human_count(count: int) -> str:
    """A parameter count as Ollama writes it: 8B, 7.6B, 134.52M, 500K."""
    for unit, scale, decimals in (("B", 10**9, 1), ("M", 10**6, 2)):
        if count >= scale:
            value = count / scale
            return f"{value:.0f}{unit}" if value.is_integer() else f"{value:.{decimals}f}{unit}"
    return f"{count / 1000:.0f}K" if count >= 1000 else str(count)


def _model_info(config: ModelConfig, parameter_count: int) -> dict[str, Any]:
    """The model's hyper-parameters under the GGUF keys Ollama reports, whatever the checkpoint's format."""
    arch = config.architecture
    return {"general.architecture": arch, "general.parameter_count": parameter_count,
            f"{arch}.context_length": config.max_position_embeddings, f"{arch}.embedding_length": config.hidden_size,
            f"{arch}.block_count": config.num_hidden_layers, f"{arch}.feed_forward_length": config.intermediate_size,
            f"{arch}.attention.head_count": config.num_attention_heads,
            f"{arch}.attention.head_count_kv": config.num_key_value_heads,
            f"{arch}.attention.key_length": config.head_dim, f"{arch}.vocab_size": config.vocab_size}


def _capabilities(llm: AsyncLLM, state: ServerState) -> list[str]:
    """What Ollama's clients may ask of the model here: tools wherever there is a chat template (where it shows
    none, they go in a system message), thinking where the server splits the model's reasoning into
    ``thinking`` (--reasoning-parser; a template's switch alone leaves it in the content), embeddings where the
    backend pools."""
    found = {"completion": True, "tools": bool(llm.tokenizer.chat_template),
             "thinking": state.reasoning_parser is not None, "embedding": bool(llm.capabilities.pooling_types)}
    return [name for name, present in found.items() if present]


def _modelfile(path: Path, parameters: list[tuple[str, Any]]) -> str:
    lines = ["# The model pocketllm-server serves, as a Modelfile. Its chat template (``template``) is Jinja,",
             "# not the Go template Ollama's TEMPLATE takes, so it is not repeated here.",
             f"FROM {path}", *(f"PARAMETER {name} {json.dumps(value)}" for name, value in parameters)]
    return "\n".join(lines) + "\n"


