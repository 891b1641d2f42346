"""The Ascend backend on the stand-in NPU gives what the torch backend gives on CPU (float32: the same ops, but for
the fused ones), and keeps its tensors on the device: the stand-in refuses an op that mixes npu and CPU tensors,
as a device does."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

from pocketllm import LLM, SamplingParams

PROMPTS = ["the cat sat on", "hello world, this is a longer prompt that spans blocks", "1 2 3"]
PARAMS = [SamplingParams(max_tokens=16, temperature=0, logprobs=2),
          SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=3),
          SamplingParams(max_tokens=16, temperature=1.2, top_k=20, seed=11, logprobs=1)]


def run(path: Any, backend: str, device: str) -> list[tuple[list[int], list[float]]]:
    llm = LLM(model=str(path), backend=backend, device=device, dtype="float32", enable_prefix_caching=True)
    try:
        outs = llm.generate(PROMPTS * 2, PARAMS * 2)  # the second copy hits the prefix cache
    finally:
        llm.shutdown()
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs or []]) for o in outs]


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5", "llama-gguf"])
def test_outputs_equal_the_torch_backend_on_cpu(torch_npu: ModuleType, pocketllm_kit_checkpoint: Any,
                                                kind: str) -> None:
    path = pocketllm_kit_checkpoint(kind)
    on_npu, on_cpu = run(path, "ascend", "npu"), run(path, "torch", "cpu")
    assert [ids for ids, _ in on_npu] == [ids for ids, _ in on_cpu]
    assert all(lps for (_, lps), p in zip(on_npu, PARAMS * 2, strict=True) if p.logprobs is not None)
    for (_, npu_lps), (_, cpu_lps) in zip(on_npu, on_cpu, strict=True):
        assert npu_lps == pytest.approx(cpu_lps, abs=1e-4)


def test_the_standin_refuses_mixed_devices(torch_npu: ModuleType) -> None:
    """What makes the parity above mean that every tensor was on the device."""
    on_device = torch.ones(4, device="npu")
    with pytest.raises(RuntimeError, match="same device"):
        on_device + torch.ones(4)
    assert (on_device * torch.tensor(2.0)).device.type == "npu"  # a CPU scalar may join, as on CUDA
    with pytest.raises(TypeError, match="numpy"):
        on_device.numpy()


def test_a_device_by_index(torch_npu: ModuleType, pocketllm_kit_checkpoint: Any) -> None:
    """``npu:1``: everything on that device (the stand-in refuses ops that mix two devices), the same outputs."""
    path = pocketllm_kit_checkpoint("qwen3_5")
    llm = LLM(model=str(path), backend="ascend", device="npu:1", dtype="float32")
    try:
        on_one = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        assert torch_npu.npu.current_device() == 1
    finally:
        llm.shutdown()
        torch_npu.npu.set_device(0)
    llm = LLM(model=str(path), backend="torch", device="cpu", dtype="float32")
    try:
        assert on_one == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    finally:
        llm.shutdown()


def test_decode_traces_on_the_device(torch_npu: ModuleType, pocketllm_kit_checkpoint: Any,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``decode_graphs`` (off by default on NPUs) is an option this backend offers: decode steps recorded on the
    device, replayed, give the eager steps' tokens."""
    from pocketllm_torch.decode_graphs import DecodeGraphs

    recorded: list[bool] = []
    record = DecodeGraphs._record

    def counted(self: DecodeGraphs, args: Any, slots: Any) -> Any:
        trace = record(self, args, slots)
        recorded.append(trace is not None and args[0].device.type == "npu")
        return trace

    monkeypatch.setattr(DecodeGraphs, "_record", counted)
    path = pocketllm_kit_checkpoint("llama")
    tokens = {}
    for traced in (False, True):
        llm = LLM(model=str(path), backend="ascend", device="npu", dtype="float32",
                  backend_options={"decode_graphs": traced})
        try:
            tokens[traced] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        finally:
            llm.shutdown()
    assert tokens[True] == tokens[False] and recorded and all(recorded)
