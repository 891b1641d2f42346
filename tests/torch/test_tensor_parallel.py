"""Tensor parallelism on the torch backend over gloo: TP=2 generates what TP=1 does, how weights split, what is
refused. The ranks here are the library's own (LLM(tensor_parallel_size=2) starts rank 1 as a child process);
tests/server/test_tensor_parallel.py launches them through the supervisor and torchrun."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest

from pocketllm import LLM, SamplingParams
from pocketllm.errors import UnsupportedOptionError
from pocketllm.testing.checkpoints import write_checkpoint

pytest.importorskip("pocketllm_torch")

from pocketllm.model_config import ModelConfig
from pocketllm_torch.groups import Int4Groups
from pocketllm_torch.tensor_parallel import Split, _columns, _rows

CONFIG = ModelConfig(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _greedy(path: str, tp: int, **kwargs: object) -> list[list[int]]:
    llm = LLM(path, backend="torch", dtype="float32", tensor_parallel_size=tp, **kwargs)
    try:
        prompts = [llm.tokenizer.encode("The capital of France is"), [5, 6, 7, 8, 9, 10], list(range(3, 60))]
        return [out.outputs[0].token_ids for out in llm.generate(prompts, GREEDY)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kind", ["llama", "qwen3", "llama-gguf", "default"])
def test_two_ranks_generate_what_one_does(kind: str, tmp_path: Path) -> None:
    """Each supported architecture, 8- and 4-bit grouped matrices (the kit's GGUF, the default model's Q4_1) and
    an uneven split of KV heads (the default model's 3 go 2 + 1)."""
    path = "smollm2-135m-instruct" if kind == "default" else str(write_checkpoint(kind, tmp_path))
    assert _greedy(path, 2) == _greedy(path, 1)


def test_two_ranks_with_prefix_caching_and_preemption(tmp_path: Path) -> None:
    path = str(write_checkpoint("llama", tmp_path))
    options = {"enable_prefix_caching": True, "max_num_seqs": 2, "backend_options": {"block_size": 4}}
    assert _greedy(path, 2, **options) == _greedy(path, 1, **options)


def test_the_split_follows_kv_heads_and_stays_in_whole_groups() -> None:
    config = CONFIG  # 4 query heads, 2 KV heads of 16
    halves = [Split.of(config, rank, 2, grouped=True) for rank in range(2)]
    assert [s.kv_heads for s in halves] == [(0, 1), (1, 2)] and [s.heads for s in halves] == [(0, 2), (2, 4)]
    assert halves[0].intermediate == (0, 64) and halves[1].intermediate == (64, 128)
    nine = msgspec.structs.replace(config, num_key_value_heads=3, num_attention_heads=9, head_dim=32)
    uneven = [Split.of(nine, rank, 2, grouped=False) for rank in range(2)]
    assert [s.kv_heads for s in uneven] == [(0, 2), (2, 3)] and [s.heads for s in uneven] == [(0, 6), (6, 9)]
    codes = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64) % 16
    groups = Int4Groups(codes, np.ones((4, 2), np.float32), np.zeros((4, 2), np.float32))
    right = _columns(groups, 32, 64)
    assert right.codes.shape == (4, 32) and right.scale.shape == (4, 1) and (right.codes == codes[:, 32:]).all()
    assert _rows(groups, 1, 3).offset.shape == (2, 2)


def test_what_cannot_be_split_is_refused_by_name() -> None:
    with pytest.raises(UnsupportedOptionError, match=r"tensor_parallel_size.*only 2 KV heads"):
        Split.of(CONFIG, 0, 4, grouped=False)
    hybrid = msgspec.structs.replace(CONFIG, architecture="qwen3_5_text")
    with pytest.raises(UnsupportedOptionError, match=r"tensor_parallel_size.*qwen3_5_text"):
        Split.of(hybrid, 0, 2, grouped=False)

