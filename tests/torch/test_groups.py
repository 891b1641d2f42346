"""4- and 8-bit groups unpacked from a GGUF's raw blocks: exactly what gguf's dequantizer gives, rows unpermuted."""

from __future__ import annotations

import numpy as np
import pytest

from pocketllm.checkpoint import load_checkpoint
from pocketllm_torch import groups
from pocketllm_torch.linear import Int4Weight, Int8Weight


@pytest.fixture(scope="module")
def kit_gguf(pocketllm_kit_checkpoint):
    return load_checkpoint(str(pocketllm_kit_checkpoint("llama-gguf")))


def test_groups_equal_the_dequantized_tensors(kit_gguf) -> None:
    seen = set()
    for tensor in kit_gguf.tensors():
        loaded = groups.load(tensor, int4=True, int8=True)
        expected = tensor.dequantize()  # gguf's dequantizer, with the reader's row permutation undone
        if tensor.storage_type in groups.INT4_TYPES:
            weight = Int4Weight.from_groups(loaded)
            assert weight.codes.max().item() <= 15
        elif tensor.storage_type in groups.INT8_TYPES:
            weight = Int8Weight.from_groups(loaded)
        else:
            assert isinstance(loaded, np.ndarray)
            continue
        seen.add((tensor.storage_type, tensor.row_permutation is not None))
        assert weight.codes.shape == tensor.shape
        np.testing.assert_array_equal(weight.dequantize().numpy(), expected, err_msg=tensor.name)
    assert {("Q4_0", False), ("Q4_1", False), ("Q8_0", True), ("Q8_0", False)} <= seen


def test_groups_only_where_asked(kit_gguf) -> None:
    tensor = next(t for t in kit_gguf.tensors() if t.storage_type == "Q4_1")
    assert isinstance(groups.load(tensor, int4=False, int8=True), np.ndarray)
    tensor = next(t for t in kit_gguf.tensors() if t.storage_type == "Q8_0")
    assert isinstance(groups.load(tensor, int4=True, int8=False), np.ndarray)
