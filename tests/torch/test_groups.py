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
        loaded = groups.load(tensor, groups.GroupFormats(int4=True, int8=True))
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
    assert isinstance(groups.load(tensor, groups.GroupFormats(int4=False, int8=True)), np.ndarray)
    tensor = next(t for t in kit_gguf.tensors() if t.storage_type == "Q8_0")
    assert isinstance(groups.load(tensor, groups.GroupFormats(int4=True, int8=False)), np.ndarray)


def random_q4_k_blocks(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw Q4_K blocks of a rows x cols matrix: random codes, 6-bit scales and mins, and fp16 d and dmin."""
    rng = np.random.default_rng(seed)
    count = rows * cols // 256
    blocks = rng.integers(0, 256, (count, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-3, 1e-2, count).astype(np.float16).view(np.uint8).reshape(count, 2)
    blocks[:, 2:4] = rng.uniform(1e-3, 1e-2, count).astype(np.float16).view(np.uint8).reshape(count, 2)
    return blocks.reshape(-1)


def test_q4_k_blocks_unpack_to_groups_as_ggufs_dequantizer_computes_them() -> None:
    """Q4_K as 4-bit groups (for the Triton GEMM): scale d * sc and offset -dmin * m per 32 give gguf's
    dequantized values bit for bit, every code and 6-bit scale and min packing exercised by random bytes."""
    import gguf
    from gguf.quants import dequantize

    rows, cols = 6, 512
    blocks = random_q4_k_blocks(rows, cols)
    loaded = groups.int4_from_q4_k(blocks, rows, cols)
    assert loaded.codes.max() <= 15
    expected = dequantize(blocks.reshape(rows, -1), gguf.GGMLQuantizationType.Q4_K)
    np.testing.assert_array_equal(Int4Weight.from_groups(loaded).dequantize().numpy(), expected)


def test_q4_k_stays_in_groups_only_where_k_quants_are_asked(tmp_path) -> None:
    """The CPU kernels take Q4_0/Q4_1 groups only: Q4_K is dequantized at load unless ``k_quants`` (the Triton
    GEMM's formats) asks for it, and then its groups dequantize to the same values."""
    from pocketllm.checkpoint.tensor import CheckpointTensor

    blocks = random_q4_k_blocks(4, 256)
    path = tmp_path / "q4_k.bin"
    path.write_bytes(blocks.tobytes())
    tensor = CheckpointTensor("w", "w", (4, 256), "Q4_K", path, 0, blocks.nbytes,
                              _buffer=np.memmap(path, dtype=np.uint8, mode="r"))
    assert isinstance(groups.load(tensor, groups.GroupFormats(int4=True, int8=True)), np.ndarray)
    loaded = groups.load(tensor, groups.GroupFormats(int4=True, int8=True, k_quants=True))
    assert isinstance(loaded, groups.Int4Groups)
    np.testing.assert_array_equal(Int4Weight.from_groups(loaded).dequantize().numpy(), tensor.dequantize())
