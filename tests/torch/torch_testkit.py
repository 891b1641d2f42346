"""Tiny random Hugging Face models as PocketLLM checkpoints, and helpers to drive a TorchEngine."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from pocketllm.args import EngineArgs, resolve_max_model_len
from pocketllm.capability_checks import check_engine_args, check_request
from pocketllm.checkpoint import CheckpointTensor
from pocketllm.model_config import ModelConfig
from pocketllm.sampling_params import SamplingParams
from pocketllm_torch import groups
from pocketllm_torch.backend import TorchBackend
from pocketllm_torch.engine import TorchEngine
from pocketllm_torch.groups import Int4Groups, Int8Groups

VOCAB = 512
EOS = 2
# Where engines under test run; set to "cuda" to run the same tests on a GPU.
DEVICE = os.environ.get("POCKETLLM_TORCH_TEST_DEVICE", "cpu")


@dataclass
class FakeCheckpoint:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor] = field(repr=False)
    # "Q4_0"/"Q4_1": the storage type of the decoder matrices; "Q8_0": of every matrix, embeddings included
    quantization: str | None = None

    def tensors(self) -> list[CheckpointTensor]:
        """The state dict as a checkpoint's tensors, quantized blocks where ``quantization`` says."""
        tensors = []
        for name, tensor in self.state_dict.items():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            array = tensor.detach().float().numpy()
            quantized = self.quantization is not None and array.ndim == 2 and (
                self.quantization == "Q8_0" or name.startswith("model.layers."))
            storage_type = self.quantization if quantized else "F32"
            raw = gguf.quants.quantize(array, gguf.GGMLQuantizationType[storage_type]) if quantized else array
            buffer = np.frombuffer(raw.tobytes(), np.uint8)
            tensors.append(CheckpointTensor(name=name, file_name=name, shape=array.shape, storage_type=storage_type,
                                            path=Path("<memory>"), offset=0, nbytes=buffer.size, _buffer=buffer))
        return tensors

    def mtp_tensors(self) -> list[CheckpointTensor]:
        return []

    def weights(self, *, grouped: bool = False) -> Iterator[tuple[str, np.ndarray | Int4Groups | Int8Groups]]:
        """What the model runner loads: with ``grouped``, 4- and 8-bit matrices stay in their groups."""
        for tensor in self.tensors():
            yield tensor.name, groups.load(tensor, groups.GroupFormats(int4=grouped, int8=grouped))


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
    """A TorchEngine behind the core's checks of its arguments, as the driver builds one."""
    engine_args = EngineArgs(**({"device": DEVICE, "dtype": "float32", "max_model_len": 256} | args))
    backend = TorchBackend()
    engine_args = dataclasses.replace(engine_args, max_model_len=resolve_max_model_len(engine_args, checkpoint.config))
    options = check_engine_args(backend.name, backend.capabilities(), engine_args, checkpoint)
    return backend.create_engine(engine_args, checkpoint, options)


def add(engine: TorchEngine, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
    """Add a request the way the driver does: through the core's checks, which resolve max_tokens."""
    config = engine.config
    params = check_request("torch", TorchBackend().capabilities(), prompt_ids, params,
                           vocab_size=config.model.vocab_size, max_model_len=config.max_model_len)
    engine.add_request(request_id, prompt_ids, params)


def greedy(max_tokens: int | None = 32, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


Requests = dict[str, tuple[list[int], SamplingParams]]


def run_to_completion(engine: TorchEngine, requests: Requests) -> dict[str, list[int]]:
    """Add every request, step until all finish, and return each request's generated tokens."""
    for request_id, (prompt, params) in requests.items():
        add(engine, request_id, prompt, params)
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
