"""4-bit GGUF matrices kept 4-bit on CPUs (torch's int4 kernel with bf16 activations): same model, bf16 accuracy."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pocketllm_torch.linear import Int4Linear, Int4Weight, make_linear, uses_int4
from pocketllm_torch.models.llama import LlamaModel
from tests.torch.test_torch_parity import our_logits
from tests.torch.torch_testkit import greedy, make_engine, prompt, run_to_completion, tiny_model

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not uses_int4(CPU, torch.bfloat16), reason="no int4 CPU kernel in this torch")


def random_int4(rows: int, cols: int) -> Int4Weight:
    g = torch.Generator().manual_seed(rows * cols)
    scale = torch.rand(rows, cols // 32, generator=g) * 0.02 + 0.01
    offset = -8 * scale + 0.01 * torch.randn(rows, cols // 32, generator=g)
    return Int4Weight(torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=g), scale, offset)


@pytest.mark.parametrize("num_rows", [1, 3, 8, 9, 40])
def test_int4_linear_matches_its_dequantized_weights(num_rows: int) -> None:
    weight, bias = random_int4(96, 128), torch.randn(96)
    linear = make_linear(weight, bias, CPU, torch.bfloat16)
    assert isinstance(linear, Int4Linear)
    x = torch.randn(num_rows, 128)
    ref = torch.nn.functional.linear(x, weight.dequantize(), bias)
    got = linear(x).float()
    assert (got - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def test_rows_the_kernel_cannot_pack_stay_dense() -> None:
    linear = make_linear(random_int4(40, 64), None, CPU, torch.bfloat16)  # 40 output rows: not a multiple of 16
    assert not isinstance(linear, Int4Linear)
    assert not isinstance(make_linear(random_int4(32, 64), None, CPU, torch.float32), Int4Linear)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_q4_model_in_bf16_tracks_its_fp32_dequantized_self(qtype: str) -> None:
    _, checkpoint = tiny_model()
    checkpoint = dataclasses.replace(checkpoint, quantization=qtype)
    config = checkpoint.config
    int4 = LlamaModel.from_weights(config, checkpoint.weights(int4_groups=True), CPU, torch.bfloat16, 256)
    assert isinstance(int4.layers[0].attn.qkv_proj, Int4Linear)
    assert isinstance(int4.layers[1].mlp.down_proj, Int4Linear)
    # Prompts of 1 and 5 tokens run the 4-bit kernel; 90 tokens run the dense copy.
    prompts = [prompt(1), prompt(5, offset=1), prompt(90, offset=2)]
    ref = our_logits(checkpoint, prompts)  # fp32 over the same (dequantized) weights
    got = our_logits(checkpoint, prompts, dtype=torch.bfloat16, int4_groups=True)
    for r, g in zip(ref, got, strict=True):
        assert (g.float() - r).abs().max().item() <= 0.05 * r.abs().max().item()
        assert (g.argmax(-1) == r.argmax(-1)).float().mean().item() >= 0.9


def test_q4_engine_in_bf16_generates_like_fp32() -> None:
    _, checkpoint = tiny_model()
    checkpoint = dataclasses.replace(checkpoint, quantization="Q4_1")
    requests = {f"r{i}": (prompt(20 + i, offset=i), greedy(16)) for i in range(4)}
    engine = make_engine(checkpoint, device="cpu", dtype="bfloat16")
    assert isinstance(engine.runner.model.layers[0].mlp.gate_up_proj, Int4Linear)
    bf16 = run_to_completion(engine, requests)
    fp32 = run_to_completion(make_engine(checkpoint, device="cpu", dtype="float32"), requests)
    # 4-bit random weights leave near-ties that bf16 may flip (here in one prompt); the rest must agree throughout.
    assert sum(bf16[r] == fp32[r] for r in requests) >= 3
