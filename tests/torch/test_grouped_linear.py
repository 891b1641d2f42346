"""GGUF matrices kept in 4- and 8-bit groups on CPUs: the same model as its dequantized fp32 self."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pocketllm_torch import linear, native
from pocketllm_torch.linear import (
    GroupedLinear,
    Int4Weight,
    Int8Weight,
    NativeGrouped,
    TorchInt4,
    compute_dtype,
    make_linear,
    uses_int4,
)
from pocketllm_torch.models.llama import LlamaModel
from tests.torch.test_torch_parity import our_logits
from tests.torch.torch_testkit import greedy, make_engine, prompt, run_to_completion, tiny_model

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not uses_int4(CPU, torch.bfloat16), reason="no int4 CPU kernel in this torch")
needs_native = pytest.mark.skipif(not native.enabled(), reason="native kernels not built or not vectorised here")


@pytest.fixture(params=["native", "torch"])
def int4_kernel(request, monkeypatch) -> str:
    """Run a test with the native int4 kernel, then with torch's (as where the extension is not built)."""
    if request.param == "native" and not native.enabled():
        pytest.skip("native kernels not built or not vectorised here")
    if request.param == "torch":
        monkeypatch.setattr(linear.native, "enabled", lambda: False)
    return request.param


def random_int4(rows: int, cols: int) -> Int4Weight:
    g = torch.Generator().manual_seed(rows * cols)
    scale = torch.rand(rows, cols // 32, generator=g) * 0.02 + 0.01
    offset = -8 * scale + 0.01 * torch.randn(rows, cols // 32, generator=g)
    return Int4Weight(torch.randint(0, 16, (rows, cols), dtype=torch.uint8, generator=g), scale, offset)


def random_int8(rows: int, cols: int) -> Int8Weight:
    g = torch.Generator().manual_seed(rows + cols)
    codes = torch.randint(-128, 128, (rows, cols), dtype=torch.int8, generator=g)
    return Int8Weight(codes, torch.rand(rows, cols // 32, generator=g) * 0.01)


@pytest.mark.parametrize("num_rows", [1, 3, 8, 9, 17, 40])
def test_int4_linear_matches_its_dequantized_weights(int4_kernel: str, num_rows: int) -> None:
    weight, bias = random_int4(96, 128), torch.randn(96)
    layer = make_linear(weight, bias, CPU, torch.bfloat16)
    assert isinstance(layer, GroupedLinear)
    assert isinstance(layer.kernel, NativeGrouped if int4_kernel == "native" else TorchInt4)
    # The native kernel serves every batch (a dense copy would change a row's numbers with the batch's size).
    assert (layer.dense is None) == (int4_kernel == "native")
    # Activations come in the layer's compute dtype: float32 where bf16 GEMM is slow, bf16 on CPUs with bf16
    # matrix instructions (AVX512-BF16, AMX), where the bias and the output are bf16 too.
    activations = compute_dtype(CPU, torch.bfloat16)
    x = torch.randn(num_rows, 128).to(activations)
    ref = torch.nn.functional.linear(x.float(), weight.dequantize(), bias.to(activations).float())
    got = layer(x).float()
    # The native kernel computes in fp32; torch's takes bf16 activations.
    tolerance = 1e-5 if int4_kernel == "native" and activations == torch.float32 else 2e-2
    assert (got - ref).abs().max().item() <= tolerance * ref.abs().max().item()


@needs_native
@pytest.mark.parametrize("num_rows", [1, 5, 40])
def test_int8_linear_matches_its_dequantized_weights(num_rows: int) -> None:
    weight, bias = random_int8(48, 96), torch.randn(48)
    layer = make_linear(weight, bias, CPU, torch.float32)
    assert isinstance(layer, GroupedLinear) and layer.dense is None  # 8-bit: no dense copy, any number of rows
    x = torch.randn(num_rows, 96)
    ref = torch.nn.functional.linear(x, weight.dequantize(), bias)
    assert (layer(x) - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


def test_matrices_the_kernels_cannot_pack_stay_dense(int4_kernel: str) -> None:
    # The native kernel pads outputs to whole blocks of 16 (a vocabulary of 323, say); torch's takes whole blocks.
    uneven = make_linear(random_int4(40, 64), None, CPU, torch.bfloat16)
    assert isinstance(uneven, GroupedLinear) == (int4_kernel == "native")
    x = torch.randn(3, 64).to(compute_dtype(CPU, torch.bfloat16))
    assert uneven(x).shape == (3, 40)
    # Only the native kernel takes fp32 activations; without it, 8-bit matrices are dequantized.
    assert isinstance(make_linear(random_int4(32, 64), None, CPU, torch.float32), GroupedLinear) == (
        int4_kernel == "native")
    assert isinstance(make_linear(random_int8(32, 64), None, CPU, torch.float32), GroupedLinear) == (
        int4_kernel == "native")


@pytest.mark.parametrize("storage_type", ["Q4_0", "Q4_1"])
def test_q4_model_in_bf16_tracks_its_fp32_dequantized_self(int4_kernel: str, storage_type: str) -> None:
    _, checkpoint = tiny_model()
    checkpoint = dataclasses.replace(checkpoint, quantization=storage_type)
    config = checkpoint.config
    int4 = LlamaModel.from_weights(config, checkpoint.weights(grouped=True), CPU, torch.bfloat16, 256)
    assert isinstance(int4.layers[0].attn.qkv_proj, GroupedLinear)
    assert isinstance(int4.layers[1].mlp.down_proj, GroupedLinear)
    # Prompts of 1 and 5 tokens run the 4-bit kernel; 90 tokens the native one, or torch's dense copy.
    prompts = [prompt(1), prompt(5, offset=1), prompt(90, offset=2)]
    ref = our_logits(checkpoint, prompts)  # fp32 over the same (dequantized) weights
    got = our_logits(checkpoint, prompts, dtype=torch.bfloat16, groups=True)
    for r, g in zip(ref, got, strict=True):
        assert (g.float() - r).abs().max().item() <= 0.05 * r.abs().max().item()
        assert (g.argmax(-1) == r.argmax(-1)).float().mean().item() >= 0.9


@needs_native
@pytest.mark.parametrize("tie", [True, False])
def test_grouped_fp32_model_equals_its_dequantized_self(tie: bool) -> None:
    """fp32 activations through the native kernels: the logits of float32 math over the same weights."""
    for storage_type in ("Q4_1", "Q8_0"):
        _, checkpoint = tiny_model(tie=tie)
        checkpoint = dataclasses.replace(checkpoint, quantization=storage_type)
        model = LlamaModel.from_weights(checkpoint.config, checkpoint.weights(grouped=True),
                                        CPU, torch.float32, 256)
        assert isinstance(model.layers[0].mlp.gate_up_proj, GroupedLinear)
        assert isinstance(model.lm_head, GroupedLinear) == (storage_type == "Q8_0")  # Q8_0 quantizes the embeddings too
        prompts = [prompt(1), prompt(7, offset=1), prompt(30, offset=2)]
        ref = our_logits(checkpoint, prompts)
        got = our_logits(checkpoint, prompts, groups=True)
        for r, g in zip(ref, got, strict=True):
            assert (g - r).abs().max().item() <= 1e-4 * r.abs().max().item(), storage_type


def test_q4_engine_in_bf16_generates_like_fp32(int4_kernel: str) -> None:
    _, checkpoint = tiny_model()
    checkpoint = dataclasses.replace(checkpoint, quantization="Q4_1")
    requests = {f"r{i}": (prompt(20 + i, offset=i), greedy(16)) for i in range(4)}
    engine = make_engine(checkpoint, device="cpu", dtype="bfloat16")
    assert isinstance(engine.runner.model.layers[0].mlp.gate_up_proj, GroupedLinear)
    bf16 = run_to_completion(engine, requests)
    fp32 = run_to_completion(make_engine(checkpoint, device="cpu", dtype="float32"), requests)
    # 4-bit random weights leave near-ties that bf16 may flip (here in one prompt); the rest must agree throughout.
    assert sum(bf16[r] == fp32[r] for r in requests) >= 3
