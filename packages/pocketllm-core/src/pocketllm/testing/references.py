"""Reference outputs of the kit's checkpoints, computed once with transformers and stored as data.

Regenerate ``data/references.json`` after changing ``checkpoints.py`` (needs torch and transformers)::

    python -m pocketllm.testing.references

The script picks, from a fixed pool of token-id prompts, pairs that differ only early on and whose greedy
continuations differ (so only a model that reads the whole context gets both right), keeping only prompts whose
top-2 logprob margin stays above MIN_MARGIN at every step (so fp32 rounding cannot flip a choice).
"""

from __future__ import annotations

import hashlib
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from pocketllm.testing import checkpoints

MAX_TOKENS = 16
TOP_LOGPROBS = 5
MIN_MARGIN = 0.02
NUM_PAIRS = 3
_DATA = "data/references.json"


class Reference(msgspec.Struct, frozen=True):
    prompt: list[int]
    token_ids: list[int]
    top_logprobs: list[list[tuple[int, float]]]  # per generated token: the top 5 (id, logprob), best first


class CheckpointReferences(msgspec.Struct, frozen=True):
    sha256: str  # tensors_sha256 of the checkpoint as checkpoints.py writes it
    references: list[Reference]


class References(msgspec.Struct, frozen=True):
    max_tokens: int
    top_logprobs: int
    generated_with: dict[str, str]
    checkpoints: dict[str, CheckpointReferences]


def load() -> References:
    return msgspec.json.decode(resources.files("pocketllm.testing").joinpath(_DATA).read_bytes(), type=References)


def tensors_sha256(path: Path) -> str:
    """A digest of a kit checkpoint's tensors (names, storage types, shapes and bytes), whatever its file layout."""
    from pocketllm.checkpoint import load_checkpoint

    digest = hashlib.sha256()
    for tensor in sorted(load_checkpoint(str(path)).tensors(), key=lambda t: t.name):
        digest.update(f"{tensor.name}:{tensor.storage_type}:{tensor.shape}".encode())
        digest.update(tensor.data)
    return digest.hexdigest()


def main() -> None:
    import torch
    import transformers

    out: dict[str, CheckpointReferences] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in checkpoints.KIT_CHECKPOINTS:
            path = checkpoints.write_checkpoint(kind, Path(tmp) / kind)
            model = _transformers_model(kind, torch, transformers)
            out[kind] = CheckpointReferences(tensors_sha256(path), _pick_references(model, torch))
            print(f"{kind}: {len(out[kind].references)} prompts")
    data = References(MAX_TOKENS, TOP_LOGPROBS, {"torch": str(torch.__version__),
                                                 "transformers": str(transformers.__version__)}, out)
    target = Path(__file__).parent / _DATA
    target.write_bytes(msgspec.json.format(msgspec.json.encode(data), indent=1) + b"\n")
    print(f"wrote {target}")


def _transformers_model(kind: str, torch: Any, transformers: Any) -> Any:
    """transformers' model over the kit weights; for the GGUF, over the blocks' dequantized values, computed with
    gguf's own quantizer (row blocks commute with llama.cpp's q/k row permutation, so it is not needed here)."""
    import gguf

    arch = "qwen3" if kind == "qwen3" else "llama"
    config_cls = transformers.Qwen3Config if arch == "qwen3" else transformers.LlamaConfig
    model_cls = transformers.Qwen3ForCausalLM if arch == "qwen3" else transformers.LlamaForCausalLM
    model = model_cls(config_cls(**checkpoints.hf_config(arch))).eval()
    weights = checkpoints.tiny_weights(arch, 1 if arch == "qwen3" else 0)
    if kind == "llama-gguf":
        gguf_names = dict(zip(weights, checkpoints.gguf_tensors(), strict=True))
        for name, array in weights.items():
            storage_type = gguf.GGMLQuantizationType[checkpoints._gguf_storage_type(gguf_names[name], array)]
            if storage_type != gguf.GGMLQuantizationType.F32:
                quantized = gguf.quants.quantize(array, storage_type)
                weights[name] = gguf.quants.dequantize(quantized, storage_type).astype(np.float32)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()}, strict=True)
    return model


def _greedy(model: Any, torch: Any, prompt: list[int]) -> tuple[Reference, float]:
    ids, tops, margin = list(prompt), [], float("inf")
    for _ in range(MAX_TOKENS):
        with torch.no_grad():
            logprobs = model(torch.tensor([ids])).logits[0, -1].double().log_softmax(-1)
        top = logprobs.topk(TOP_LOGPROBS)
        margin = min(margin, (top.values[0] - top.values[1]).item())
        tops.append([(int(i), float(v)) for i, v in zip(top.indices, top.values, strict=True)])
        ids.append(int(top.indices[0]))
    return Reference(list(prompt), ids[len(prompt):], tops), margin


def _pick_references(model: Any, torch: Any) -> list[Reference]:
    rng = np.random.default_rng(2026)
    vocab = model.config.vocab_size
    chosen: list[Reference] = []
    for length in [5, 9, 14, 22, 31, 40] * 10:
        if len(chosen) == 2 * NUM_PAIRS:
            break
        first = [int(t) for t in rng.integers(3, vocab, size=length)]
        second = [int(t) for t in rng.integers(3, vocab, size=length // 2)] + first[length // 2:]
        pair = [_greedy(model, torch, p) for p in (first, second)]
        if all(margin >= MIN_MARGIN for _, margin in pair) and pair[0][0].token_ids != pair[1][0].token_ids:
            chosen += [ref for ref, _ in pair]
    if len(chosen) < 2 * NUM_PAIRS:
        raise SystemExit("too few prompts with clear margins: change the kit checkpoints' weight scales")
    return chosen


if __name__ == "__main__":
    main()
