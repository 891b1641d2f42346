"""GGUF files (llama.cpp): metadata, and tensors described in Hugging Face names and layout.

Architectures llama.cpp and transformers both know are mapped to the transformers ``model_type`` and tensor
names; any other architecture comes through with GGUF's own names, for a backend that knows it to take.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf

from pocketllm.checkpoint.base import Checkpoint, RecommendedSetting
from pocketllm.checkpoint.configs import (
    GGUF_ARCHITECTURES,
    GGUF_SAMPLING_KEYS,
    config_from_gguf,
    gguf_key_of,
    recommended_settings,
)
from pocketllm.checkpoint.gguf_file import GGUFFile, GGUFFormatError, TensorHeader, read_gguf
from pocketllm.checkpoint.shapes import check_mtp_shapes, check_shapes
from pocketllm.checkpoint.tensor import CheckpointTensor, RowPermutation
from pocketllm.errors import CheckpointError
from pocketllm.model_config import ModelConfig

# GGUF tensor base names (without .weight/.bias) -> Hugging Face module names, for the tensors llama.cpp's
# converter only renamed (and, for Llama's q/k, permuted: see RowPermutation). A tensor whose values it changed
# keeps its GGUF name, since a Hugging Face name would promise values it does not have. In the hybrid
# architectures that is every RMSNorm weight (stored as 1 + w), ssm_a (-exp(A_log)), the squeezed conv1d, and
# the linear-attention projections it split (Qwen3-Next's qkvz) or whose value heads it reordered (Qwen3.5).
_GLOBAL = {"token_embd": "model.embed_tokens", "output": "lm_head"}
_NORMS = {"output_norm": "model.norm"}
_ATTENTION = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
}
_ATTENTION_NORMS = {
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
}
_DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
# Experts are stacked along a leading expert axis: [experts, out, in] in Hugging Face order.
_MOE = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_LINEAR_ATTENTION = {"ssm_norm": "linear_attn.norm"}
_PLAIN = _GLOBAL | _NORMS | _ATTENTION | _ATTENTION_NORMS
_NAMES: dict[str, dict[str, str]] = {
    "llama": _PLAIN | _DENSE_MLP,
    "qwen2": _PLAIN | _DENSE_MLP,
    "qwen3": _PLAIN | _DENSE_MLP,
    "qwen3_moe": _PLAIN | _MOE,
    "qwen3_next": _GLOBAL | _ATTENTION | _MOE | _LINEAR_ATTENTION
    | {"ssm_ba": "linear_attn.in_proj_ba", "ssm_out": "linear_attn.out_proj"},
    "qwen3_5_text": _GLOBAL | _ATTENTION | _DENSE_MLP | _LINEAR_ATTENTION,
    "qwen3_5_moe_text": _GLOBAL | _ATTENTION | _MOE | _LINEAR_ATTENTION,
}
assert set(_NAMES) == set(GGUF_ARCHITECTURES.values())
_TOP_LEVEL = frozenset(_GLOBAL) | frozenset(_NORMS)
# Architectures whose q/k rows llama.cpp's converter permuted into its RoPE layout.
_PERMUTES_QK = frozenset({"llama"})
# llama.cpp precomputes Llama 3 rope frequencies as a tensor; Hugging Face models compute them instead.
_SKIPPED = frozenset({"rope_freqs.weight"})
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER_ANY = re.compile(r"blk\.(\d+)\..+")
_UNQUANTIZED = frozenset({"ALL_F32", "F32", "F16", "BF16"})
# Matrices of one row in Hugging Face layout. llama.cpp's own GGUF writer (llama-quantize's files) drops a tensor's
# trailing dimensions of 1, so these come back 1-D; its Python converter keeps them.
_ONE_ROW = ("mlp.shared_expert_gate.weight",)


class GGUFCheckpoint(Checkpoint):
    format = "gguf"

    def __init__(self, path: Path) -> None:
        try:
            file = read_gguf(path)
        except GGUFFormatError as e:
            raise CheckpointError(f"{path}: {e}") from None
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read: {e}") from None
        meta = file.metadata
        self._metadata = meta
        config = config_from_gguf(meta, source=str(path), tensor_names={t.name for t in file.tensors})
        mtp = [_describe(t, file, path, config) for t in file.tensors if _is_mtp(t.name, config)]
        tensors = [_describe(t, file, path, config) for t in file.tensors
                   if t.name not in _SKIPPED and not _is_mtp(t.name, config)]
        check_shapes(tensors, config, lambda field: gguf_key_of(field, meta))
        check_mtp_shapes(mtp, config, lambda field: gguf_key_of(field, meta))
        super().__init__(path, config, tensors, _quantization(meta.get("general.file_type"), file.tensors), mtp)

    @property
    def gguf_metadata(self) -> Mapping[str, Any]:
        return self._metadata

    def config_key(self, field: str) -> str:
        return gguf_key_of(field, self._metadata)

    def recommended_sampling(self) -> list[RecommendedSetting]:
        return recommended_settings(self._metadata, GGUF_SAMPLING_KEYS)

    def pooling_type(self) -> str | None:
        value = self._metadata.get(f"{self._metadata.get('general.architecture')}.pooling_type")
        return _GGUF_POOLING.get(value) if isinstance(value, int) else None


# llama.cpp's enum llama_pooling_type: 0 is "none" (a generative model), 4 "rank" (rerankers, not served).
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last", 4: "rank"}


def _is_mtp(name: str, config: ModelConfig) -> bool:
    match = _LAYER_ANY.fullmatch(name)
    return ("nextn_predict_layers" in config.extra and match is not None
            and int(match[1]) >= config.num_hidden_layers)


def hf_name(name: str, architecture: str) -> str:
    """The Hugging Face name of a GGUF tensor (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``)
    where the architecture is mapped and the tensor only renamed; the GGUF name itself otherwise."""
    names = _NAMES.get(architecture, {})
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return name
    match = _LAYER.fullmatch(name)
    if match is None:
        return f"{names[base]}.{suffix}" if base in names and base in _TOP_LEVEL else name
    return f"model.layers.{match[1]}.{names[match[2]]}.{suffix}" if match[2] in names else name


def _describe(tensor: TensorHeader, file: GGUFFile, path: Path, config: ModelConfig) -> CheckpointTensor:
    # GGUF lists dimensions fastest-first; Hugging Face layout is the reverse.
    shape = tuple(reversed(tensor.dims))
    name = hf_name(tensor.name, config.architecture)
    if len(shape) == 1 and name.endswith(_ONE_ROW):
        shape = (1, *shape)
    permutation = None
    if config.architecture in _PERMUTES_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
        heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
        if shape[0] % (2 * heads):
            raise CheckpointError(f"{path}: tensor {tensor.name!r}: {shape[0]} rows do not split into {heads} "
                                  "heads of row pairs")
        permutation = RowPermutation(heads)
    return CheckpointTensor(name=name, file_name=tensor.name, shape=shape, storage_type=tensor.storage_type.name,
                            path=path, offset=tensor.offset, nbytes=tensor.nbytes, row_permutation=permutation,
                            _buffer=file.tensor_bytes(tensor))


def _quantization(file_type: object, tensors: list[TensorHeader]) -> str | None:
    """The file's quantization as llama.cpp names it ("Q4_1", "Q4_K_M"), or None for a float file."""
    try:
        name = gguf.LlamaFileType(int(file_type) & ~gguf.LlamaFileType.GUESSED).name  # type: ignore[arg-type]
    except (TypeError, ValueError):
        # No or unknown file type: name it after the most common storage type among the matrices.
        types = [t.storage_type.name for t in tensors if len(t.dims) > 1]
        name = max(set(types), key=types.count) if types else "ALL_F32"
    name = name.removeprefix("MOSTLY_")
    return None if name in _UNQUANTIZED else name
