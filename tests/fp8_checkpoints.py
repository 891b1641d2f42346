"""FP8 checkpoints made from the kit's float32 ones, as transformers' FP8 quantizer writes them (it runs only on a
GPU, so its steps are repeated here): every linear projection of the layers ``*proj.weight`` stored as
``torch.float8_e4m3fn`` of ``w / scale``, with ``scale = amax / 448`` per block of ``weight_block_size`` rows x
columns saved beside it as ``*.weight_scale_inv`` (float32), and ``quantization_config`` as
``FineGrainedFP8Config(weight_block_size=...).to_dict()`` in config.json. Scales per row or per tensor
(``*.weight_scale``) are written the same way, with no block size.

Each FP8 checkpoint comes with a float32 twin holding its exact values (torch's own E4M3 conversion times the
scale): the reference a backend's output on the FP8 checkpoint is compared with.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0  # the largest finite E4M3 value


def quantized(name: str, tensor: torch.Tensor) -> bool:
    return name.endswith("proj.weight") and tensor.dim() == 2


def block_scales(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """amax / 448 of each block (the last of each axis may be partial), at least a tiny positive value."""
    rows, cols = w.shape
    padded = torch.zeros(-(-rows // block[0]) * block[0], -(-cols // block[1]) * block[1])
    padded[:rows, :cols] = w.abs()
    blocks = padded.view(padded.shape[0] // block[0], block[0], padded.shape[1] // block[1], block[1])
    return (blocks.amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)


def expand(scale: torch.Tensor, block: tuple[int, int], shape: torch.Size) -> torch.Tensor:
    return scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:shape[0], :shape[1]]


def write_fp8(source: Path, out: Path, *, scales: str = "block", block: tuple[int, int] = (128, 128)) -> Path:
    """``source`` (a kit safetensors checkpoint) with its projections in FP8; ``scales``: "block" (per ``block``,
    ``weight_scale_inv``), "channel" (per row) or "tensor" (one), both as ``weight_scale``. Returns ``out``, beside
    which ``<out>-reference`` holds the float32 values of the FP8 weights."""
    from transformers import FineGrainedFP8Config

    weights = load_file(source / "model.safetensors")
    fp8: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if not quantized(name, w):
            fp8[name] = reference[name] = w
            continue
        w = w.float()
        shape = {"block": block, "channel": (1, w.shape[1]), "tensor": tuple(w.shape)}[scales]
        scale = block_scales(w, shape)
        codes = (w / expand(scale, shape, w.shape)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        fp8[name] = codes
        stem = name.removesuffix(".weight")
        if scales == "block":
            fp8[stem + ".weight_scale_inv"] = scale.contiguous()
        else:
            fp8[stem + ".weight_scale"] = scale.reshape(-1, 1) if scales == "channel" else scale.reshape(())
        reference[name] = codes.to(torch.float32) * expand(scale, shape, w.shape)
    config = json.loads((source / "config.json").read_text())
    for folder, tensors in ((out, fp8), (out.parent / f"{out.name}-reference", reference)):
        shutil.copytree(source, folder, dirs_exist_ok=True)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    quantization = FineGrainedFP8Config(**({"weight_block_size": list(block)} if scales == "block" else {})).to_dict()
    if scales != "block":  # vLLM's per-tensor FP8 checkpoints: no block size
        quantization["weight_block_size"] = None
    (out / "config.json").write_text(json.dumps(config | {"quantization_config": quantization}, indent=2,
                                                sort_keys=True) + "\n")
    return out


def reference_of(fp8: Path) -> Path:
    return fp8.parent / f"{fp8.name}-reference"
