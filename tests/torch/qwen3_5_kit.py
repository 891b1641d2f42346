"""Tiny random Qwen3.5 checkpoints (dense, MoE, and the multimodal wrapper's layout) written with transformers'
own classes, for the fidelity tests of the hybrid models."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.torch.torch_testkit import EOS, VOCAB

HIDDEN = 64


def hf_config(moe: bool, layers: int) -> Any:
    transformers = __import__("transformers")
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=layers,
        layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        # Hv > Hk: each key head serves two value heads.
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, max_position_embeddings=1024, tie_word_embeddings=False,
        eos_token_id=EOS, bos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    )
    if moe:
        return transformers.Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                 shared_expert_intermediate_size=48, **common)
    return transformers.Qwen3_5TextConfig(**common)


def tiny_qwen3_5(path: Path, *, moe: bool = False, wrapped: bool = False, layers: int = 4,
                 seed: int = 0) -> tuple[Any, Path]:
    """A random fp32 transformers model and its checkpoint directory.

    Weights are drawn larger than transformers' init so that greedy decoding does not collapse into one token;
    zero-centred norms (weight w, applied as 1 + w) get small w. ``wrapped`` rewrites the checkpoint in the
    layout of the multimodal release (``qwen3_5``/``qwen3_5_moe`` with ``text_config``, text weights under
    ``model.language_model.``, a vision tower beside them).
    """
    transformers = __import__("transformers")
    config = hf_config(moe, layers)
    model_cls = transformers.Qwen3_5MoeForCausalLM if moe else transformers.Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif "norm" in name:
                param.copy_(0.1 * torch.randn_like(param))
            elif not name.endswith(("A_log", "dt_bias")):
                param.normal_(0, 0.15)
    model.save_pretrained(path)
    if wrapped:
        _wrap(path, "qwen3_5_moe" if moe else "qwen3_5")
    return model, path


def _wrap(path: Path, model_type: str) -> None:
    text = json.loads((path / "config.json").read_text())
    wrapper = {"model_type": model_type, "architectures": ["Qwen3_5ForConditionalGeneration"],
               "tie_word_embeddings": text.pop("tie_word_embeddings"), "text_config": text,
               "vision_config": {"model_type": f"{model_type}_vision", "hidden_size": 8}}
    (path / "config.json").write_text(json.dumps(wrapper))
    weights = load_file(path / "model.safetensors")
    renamed = {name if name == "lm_head.weight" else name.replace("model.", "model.language_model.", 1): w
               for name, w in weights.items()}
    renamed["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3)
    renamed["mtp.fc.weight"] = torch.zeros(HIDDEN, 2 * HIDDEN)
    save_file(renamed, path / "model.safetensors")
