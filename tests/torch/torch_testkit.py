"""Tiny random Hugging Face models as PocketLLM checkpoints, and helpers to drive a TorchEngine."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import gguf
import numpy as np
import torch

from pocketllm.args import EngineArgs
from pocketllm.checkpoint import int4, int8
from pocketllm.model_config import ModelConfig
from pocketllm.sampling_params import SamplingParams
from pocketllm_torch.backend import TorchBackend
from pocketllm_torch.engine import TorchEngine

VOCAB = 512
EOS = 2
# Where engines under test run; set to "cuda" to run the same tests on a GPU.
DEVICE = os.environ.get("POCKETLLM_TORCH_TEST_DEVICE", "cpu")


@dataclass
class FakeCheckpoint:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor] = field(repr=False)
    # "Q4_0"/"Q4_1": decoder matrices are stored in that GGUF format; "Q8_0": every matrix, embeddings included
    quantization: str | None = None

    def weights(self, *, int4_groups: bool = False,
                int8_groups: bool = False) -> Iterator[tuple[str, np.ndarray | int4.Int4Groups | int8.Int8Groups]]:
        for name, tensor in self.state_dict.items():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            array = tensor.detach().float().numpy()
            eight = self.quantization == "Q8_0"
            if self.quantization is None or not (eight or name.startswith("model.layers.")) or array.ndim != 2:
                yield name, array
                continue
            qtype = gguf.GGMLQuantizationType[self.quantization]
            groups = (int8 if eight else int4).from_gguf_blocks(gguf.quants.quantize(array, qtype), qtype, *array.shape)
            yield name, groups if (int8_groups if eight else int4_groups) else groups.dequantize()


def tiny_model(arch: str = "llama", tie: bool = False, layers: int = 2, seed: int = 0,
               rope_scaling: dict | None = None) -> tuple[Any, FakeCheckpoint]:
    """A random fp32 HF model and the same weights as a checkpoint.

    Weights are drawn larger than HF's init so greedy decoding does not collapse into repeating one token.
    """
    transformers = __import__("transformers")
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  tie_word_embeddings=tie, eos_token_id=EOS, bos_token_id=1)
    rope = {"rope_type": "default", "rope_theta": 10000.0} | (rope_scaling or {})
    if arch == "qwen3":
        hf_config = transformers.Qwen3Config(head_dim=32, rope_parameters=rope, **common)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        hf_config = transformers.LlamaConfig(rope_parameters=rope, **common)
        model_cls = transformers.LlamaForCausalLM
    torch.manual_seed(seed)
    model = model_cls(hf_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.15)
    config = ModelConfig(
        architecture=arch, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hf_config.head_dim,
        rms_norm_eps=hf_config.rms_norm_eps, rope_theta=10000.0, rope_scaling=rope_scaling,
        max_position_embeddings=1024, tie_word_embeddings=tie, bos_token_id=1, eos_token_ids=(EOS,),
    )
    return model, FakeCheckpoint(config, model.state_dict())


def make_engine(checkpoint: FakeCheckpoint, **args: Any) -> TorchEngine:
    args = {"device": DEVICE, "dtype": "float32", "max_model_len": 256} | args
    return TorchBackend().create_engine(EngineArgs(**args), checkpoint)


def greedy(max_tokens: int = 32, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


Requests = dict[str, tuple[list[int], SamplingParams]]


def run_to_completion(engine: TorchEngine, requests: Requests) -> dict[str, list[int]]:
    """Add every request, step until all finish, and return each request's generated tokens."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    outputs: dict[str, list[int]] = {request_id: [] for request_id in requests}
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
    return outputs


def prompt(n: int, offset: int = 0) -> list[int]:
    return [(37 * i + 11 * offset) % (VOCAB - 3) + 3 for i in range(n)]


def hf_greedy(model: Any, prompt_ids: list[int], max_tokens: int) -> list[int]:
    model.generation_config.eos_token_id = None  # as with ignore_eos: EOS may be chosen but does not stop
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
