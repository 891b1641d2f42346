"""torch_npu's fused operators behind the torch backend's seams (pocketllm_ascend.fused_ops) against the seams' torch
reference (pocketllm_torch.fused_ops.FusedOps), on the stand-in NPU; and the engine calling them there."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from pocketllm import LLM, SamplingParams
from pocketllm_torch.fused_ops import FusedOps

REFERENCE = FusedOps()
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture(scope="module")
def fused(torch_npu: ModuleType) -> FusedOps:
    from pocketllm_ascend.fused_ops import NpuFusedOps

    return NpuFusedOps()


def npu(t: torch.Tensor) -> torch.Tensor:
    return t.to("npu")


def assert_close(fused: torch.Tensor, reference: torch.Tensor) -> None:
    assert fused.device.type == "npu" and fused.dtype == reference.dtype and fused.shape == reference.shape
    tol = TOLERANCE[reference.dtype]
    torch.testing.assert_close(fused.cpu().float(), reference.cpu().float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norms(fused: FusedOps, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    x, delta = (npu(torch.randn(7, 3, 96, generator=g).to(dtype)) for _ in range(2))
    weight = npu(torch.rand(96, generator=g).to(dtype) + 0.5)
    assert_close(fused.rms_norm(x, weight, 1e-6), REFERENCE.rms_norm(x, weight, 1e-6))
    for got, reference in zip(fused.add_rms_norm(x, delta, weight, 1e-5),
                              REFERENCE.add_rms_norm(x, delta, weight, 1e-5), strict=True):
        assert_close(got, reference)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(fused: FusedOps, dtype: torch.dtype) -> None:
    gate_up = npu(torch.randn(5, 2 * 48, generator=torch.Generator().manual_seed(1)).to(dtype))
    assert_close(fused.silu_mul(gate_up), REFERENCE.silu_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_rotary(fused: FusedOps, dtype: torch.dtype, interleaved: bool, head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    x = npu(torch.randn(9, 4, head_dim, generator=g).to(dtype))
    angles = torch.rand(9, head_dim // 2, generator=g) * 6.3
    cos, sin = npu(angles.cos()), npu(angles.sin())
    assert_close(fused.rotary(x, cos, sin, interleaved=interleaved),
                 REFERENCE.rotary(x, cos, sin, interleaved=interleaved))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])  # the kernel's; float32 stays with torch (below)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("queries", [1, 5])
def test_attention(fused: FusedOps, dtype: torch.dtype, heads: int, kv_heads: int, queries: int) -> None:
    """GQA ratios 1, 3 and 8, decode (one query) and prefill rows, a causal mask with padding."""
    g = torch.Generator().manual_seed(heads * 10 + queries)
    batch, context, dim = 3, 16, 64
    q = npu(torch.randn(batch, heads, queries, dim, generator=g).to(dtype))
    k, v = (npu(torch.randn(batch, kv_heads, context, dim, generator=g).to(dtype)) for _ in range(2))
    lengths = torch.tensor([16, 9, 5])
    positions = lengths[:, None] - queries + torch.arange(queries)  # each sequence's last query rows
    hidden = torch.arange(context)[None, None, :] > positions[:, :, None].clamp(min=0)
    mask = npu(torch.zeros(batch, 1, queries, context, dtype=dtype).masked_fill(hidden[:, None], float("-inf")))
    assert_close(fused.attention(q, k, v, mask, dim ** -0.5), REFERENCE.attention(q, k, v, mask, dim ** -0.5))


def test_float32_attention_stays_with_torch(fused: FusedOps, torch_npu: ModuleType,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the fused attention kernel takes fp16 and bf16 only")

    monkeypatch.setattr(torch_npu, "npu_fused_infer_attention_score", refuse)
    q, k, v = (npu(torch.randn(1, 2, 3, 64)) for _ in range(3))
    mask = npu(torch.zeros(1, 1, 3, 3))
    assert_close(fused.attention(q, k, v, mask, 0.125), REFERENCE.attention(q, k, v, mask, 0.125))


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_the_engine_runs_the_fused_operators(torch_npu: ModuleType, pocketllm_kit_checkpoint: Any,
                                             monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """A bf16 generation on the stand-in goes through every torch_npu operator (float32 attention would not: the
    kernel takes fp16 and bf16 only): Llama's interleaved rotary, Qwen3.5's partial rotate-half."""
    calls: dict[str, int] = {}
    for name in ("npu_rms_norm", "npu_add_rms_norm", "npu_swiglu", "npu_rotary_mul", "npu_fused_infer_attention_score"):
        def counted(*args: object, __name: str = name, __op: object = getattr(torch_npu, name), **kwargs: object):
            calls[__name] = calls.get(__name, 0) + 1
            return __op(*args, **kwargs)  # type: ignore[operator]
        monkeypatch.setattr(torch_npu, name, counted)
    llm = LLM(model=str(pocketllm_kit_checkpoint(kind)), backend="ascend", device="npu", dtype="bfloat16")
    try:
        [out] = llm.generate(["the cat sat"], SamplingParams(max_tokens=4, temperature=0))
    finally:
        llm.shutdown()
    assert len(out.outputs[0].token_ids) == 4
    assert set(calls) == {"npu_rms_norm", "npu_add_rms_norm", "npu_swiglu", "npu_rotary_mul",
                          "npu_fused_infer_attention_score"}, calls


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_fused_operators_keep_bf16_as_accurate(torch_npu: ModuleType, pocketllm_kit_checkpoint: Any,
                                               monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """bf16 on the stand-in with the fused operators and without (the torch ops on the same device), each against
    float32 on the torch backend: every prompt token's logprob, teacher-forced (greedy ids of the kit's random
    models, whose margins are small, part ways at the first rounding that differs). The kit's models are far from
    float32 in bf16 either way (up to ~1.3 nats on Llama, ~0.2 on average): the fused operators may round
    otherwise, not worse."""
    from pocketllm_ascend.platform import NpuPlatform

    prompt = "the cat sat on the mat and then it went to sleep for a while 1 2 3 4"

    def prompt_logprobs(backend: str, device: str, dtype: str) -> np.ndarray:
        llm = LLM(model=str(pocketllm_kit_checkpoint(kind)), backend=backend, device=device, dtype=dtype)
        try:
            [out] = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))
        finally:
            llm.shutdown()
        return np.array([lp.logprob for lp in out.prompt_logprobs[1:]])  # the first token has none

    reference = prompt_logprobs("torch", "cpu", "float32")
    fused = np.abs(prompt_logprobs("ascend", "npu", "bfloat16") - reference)
    monkeypatch.setattr(NpuPlatform, "fused_ops", lambda self: None)
    plain = np.abs(prompt_logprobs("ascend", "npu", "bfloat16") - reference)
    assert len(reference) > 10 and not np.array_equal(fused, plain)  # the fused operators ran: they round otherwise
    assert fused.mean() <= 1.5 * plain.mean() + 0.02 and fused.max() <= 2 * plain.max() + 0.05, (fused, plain)
