"""The Qwen3.5 checkpoints of the bench: random weights in the configuration of a published model, written with
transformers' own config and model classes, converted by llama.cpp's convert_hf_to_gguf.py and quantized by
llama-quantize's library function (``llama_model_quantize``, what the tool runs), kept for the next run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pocketllm.testing import checkpoints

ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
        "mrope_interleaved": True}
# The text_config of Qwen/Qwen3.5-0.8B (huggingface.co/Qwen/Qwen3.5-0.8B/blob/main/config.json), the smallest
# published Qwen3.5, as quoted alike by several public reimplementations; its model card: 24 layers, hidden 1024,
# 8 heads, 2 KV heads. Left out: the vision tower, and its multi-token-prediction layer (mtp_num_hidden_layers 1),
# which qwen3_5_mtp.py adds, fitted, for its own bench.
DENSE_0_8B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                  linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                  linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=262144,
                  tie_word_embeddings=True, rope_parameters=ROPE)
# Qwen/Qwen3.5-35B-A3B's text_config (the smallest published MoE; same sources), scaled to fit 23 GB of RAM with
# every engine loaded: 12 of its 40 layers and 32 of its 256 experts, 8 routed per token as there (so a quarter of
# the experts rather than 1/32), every other size as published. About 2.7 B parameters, 1.6 GB as Q4_K_M.
MOE_35B_A3B_SCALED = dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=12, num_attention_heads=16,
                          num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                          linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                          num_experts=32, num_experts_per_tok=8, moe_intermediate_size=512,
                          shared_expert_intermediate_size=512, rms_norm_eps=1e-6, max_position_embeddings=262144,
                          tie_word_embeddings=False, rope_parameters=ROPE)
SHARD_BYTES = 1 << 30  # safetensors shards written one at a time, so that no full copy of the weights is held
# llama.cpp's converter refuses a pre-tokenizer whose hash it does not list, which the kit's is not; the file says
# qwen35, as Qwen3.5's own tokenizer's would (the same wrapper as tests/torch/qwen3_5_kit.py's).
CONVERT = """
import runpy, sys
root = sys.argv.pop(1)
sys.path[:0] = [root, root + "/gguf-py"]
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen35"
sys.argv[0] = root + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""
SDIST = "POCKETLLM_LLAMA_CPP_SDIST"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    moe: bool
    config: dict[str, Any] = field(repr=False)

    def with_layers(self, layers: int | None) -> ModelSpec:
        if layers is None:
            return self
        return ModelSpec(f"{self.name}-{layers}l", self.moe, self.config | {"num_hidden_layers": layers})

    def layer_types(self) -> list[str]:
        return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                for i in range(self.config["num_hidden_layers"])]


MODELS = {"dense": ModelSpec("qwen3_5-0.8b", False, DENSE_0_8B),
          "moe": ModelSpec("qwen3_5-35b-a3b-scaled", True, MOE_35B_A3B_SCALED)}


def gguf_file(spec: ModelSpec, folder: Path, quant: str = "Q4_K_M") -> Path:
    """``folder/<name>-<quant>.gguf``, made unless it is there (the float intermediates are deleted)."""
    def make(tmp: Path, out: Path) -> None:
        quantize(convert(write_checkpoint(spec, tmp / "hf"), tmp / "bf16.gguf"), out, quant)

    return made_once(folder / f"{spec.name}-{quant}.gguf", make)


def made_once(out: Path, make: Callable[[Path, Path], None]) -> Path:
    """``out``, made by ``make(scratch folder, where to write it)`` unless it is there: written beside it and
    renamed into place, so that an interrupted run leaves no half file (the scratch folder is deleted)."""
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        make(Path(tmp), Path(tmp) / out.name)
        os.replace(Path(tmp) / out.name, out)
    return out


def write_checkpoint(spec: ModelSpec, path: Path) -> Path:
    """Random bfloat16 weights of transformers' class for ``spec``, with the kit's byte-level tokenizer."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config_cls = transformers.Qwen3_5MoeTextConfig if spec.moe else transformers.Qwen3_5TextConfig
    config = config_cls(layer_types=spec.layer_types(), eos_token_id=checkpoints.EOS_TOKEN_ID, **spec.config)
    config.architectures = ["Qwen3_5MoeForCausalLM" if spec.moe else "Qwen3_5ForCausalLM"]
    with torch.device("meta"):  # names and shapes only
        model = (transformers.Qwen3_5MoeForCausalLM if spec.moe else transformers.Qwen3_5ForCausalLM)(config)
    shapes = {n: t.shape for n, t in model.state_dict().items()
              if not (n == "lm_head.weight" and config.tie_word_embeddings)}
    path.mkdir(parents=True)
    config.save_pretrained(path)
    checkpoints._write_tokenizer(path)
    generator = torch.Generator().manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    for i, (name, shape) in enumerate(shapes.items()):
        shard[name] = _random(name, shape, generator)
        if sum(t.nbytes for t in shard.values()) >= SHARD_BYTES or i == len(shapes) - 1:
            file = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
            save_file(shard, path / file, metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, file)
            shard = {}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _random(name: str, shape: Any, generator: Any) -> Any:
    """Values in the ranges transformers' init gives: only the bytes matter to speed, but not NaNs or overflow."""
    import torch

    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1, 16, generator=generator).log()
    if name.endswith(("dt_bias", "linear_attn.norm.weight")):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith("norm.weight"):  # the zero-centred norms, applied as 1 + w
        return torch.zeros(shape, dtype=torch.bfloat16)
    return torch.empty(shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=generator)


def convert(model: Path, out: Path, *, mtp: bool = False) -> Path:
    """``model`` as a bfloat16 GGUF, by the convert_hf_to_gguf.py of the llama-cpp-python sdist that
    $POCKETLLM_LLAMA_CPP_SDIST names (the noxfile's bench session sets it); with ``mtp``, its multi-token-prediction
    head too (the converter's default), else without (``--no-mtp``)."""
    source = os.environ.get(SDIST)
    if not source:
        raise SystemExit(f"${SDIST} names no llama-cpp-python sdist (nox -s bench sets it)")
    root = out.parent / "llama.cpp"
    with tarfile.open(source) as tar:
        wanted = ("conversion/", "gguf-py/", "convert_hf_to_gguf.py")
        tar.extractall(root, members=[m for m in tar.getmembers()
                                      if any(f"/vendor/llama.cpp/{part}" in m.name for part in wanted)],
                       filter="data")
    converter = next(root.glob("*/vendor/llama.cpp"))
    subprocess.run([sys.executable, "-c", CONVERT, str(converter), str(model), "--outfile", str(out), "--outtype",
                    "bf16", *([] if mtp else ["--no-mtp"])], check=True)
    return out


def quantize(src: Path, dst: Path, quant: str, threads: int = 2, *, requantize: bool = False) -> Path:
    """What ``llama-quantize src dst quant threads`` writes (the tool runs this library function); ``requantize``:
    ``src`` may be quantized already (the tool's ``--allow-requantize``)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}")
    params.nthread = threads
    params.allow_requantize = requantize
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {quant}) failed")
    return dst
