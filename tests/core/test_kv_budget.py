"""KV-cache sizing (pocketllm.kv_budget), the one rule both backends size their caches by."""

from __future__ import annotations

import msgspec
import pytest

from pocketllm import ConfigError
from pocketllm.kv_budget import KVBudget, bytes_per_block, snapshot_capacity

MiB = 1 << 20
# 16-token blocks of 1 MiB; a sequence of 256 tokens takes 16 of them.
BUDGET = KVBudget(block_size=16, bytes_per_block=MiB, max_model_len=256, max_num_seqs=4, memory_bytes=1000 * MiB,
                  device_bytes=4000 * MiB)


def test_bytes_per_block_count_keys_and_values_of_every_layer() -> None:
    per_block = bytes_per_block(num_layers=30, num_kv_heads=3, head_dim=64, itemsize=2, block_size=16)
    assert per_block == 2 * 30 * 3 * 64 * 2 * 16


def test_every_sequence_at_full_length_when_the_budget_allows_it() -> None:
    assert BUDGET.blocks_per_sequence == 16
    assert BUDGET.num_blocks() == 4 * 16
    ragged = msgspec.structs.replace(BUDGET, max_model_len=257)  # a partial block counts as a block
    assert ragged.blocks_per_sequence == 17 and ragged.num_blocks() == 4 * 17


def test_what_the_budget_holds_when_that_is_less() -> None:
    assert msgspec.structs.replace(BUDGET, memory_bytes=40 * MiB + MiB // 2).num_blocks() == 40


def test_state_slots_and_snapshots_come_out_of_the_budget_first() -> None:
    hybrid = msgspec.structs.replace(BUDGET, memory_bytes=100 * MiB, state_slot_bytes=5 * MiB, snapshot_bytes=20 * MiB)
    assert hybrid.state_bytes == 4 * 5 * MiB + 20 * MiB
    assert hybrid.num_blocks() == 60


def test_a_budget_smaller_than_one_sequence_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"15 KV blocks of 16 tokens .* cannot hold one sequence of "
                                          r"max_model_len=256") as err:
        msgspec.structs.replace(BUDGET, memory_bytes=15 * MiB).num_blocks()
    assert err.value.field == "backend_options"


def test_states_that_eat_the_whole_budget_leave_no_block_and_are_refused() -> None:
    greedy = msgspec.structs.replace(BUDGET, memory_bytes=100 * MiB, state_slot_bytes=30 * MiB)
    with pytest.raises(ConfigError, match=r"0 KV blocks .* after 125829120 for state slots and snapshots"):
        greedy.num_blocks()


def test_an_explicit_number_of_blocks_is_taken_as_it_is() -> None:
    assert BUDGET.num_blocks(16) == 16  # one sequence: enough
    assert BUDGET.num_blocks(2000) == 2000  # more than the budget, within the device
    with pytest.raises(ConfigError, match="15 KV blocks of 16 tokens cannot hold one sequence"):
        BUDGET.num_blocks(15)


def test_an_explicit_number_of_blocks_beyond_the_device_is_refused() -> None:
    with pytest.raises(ConfigError, match="4001 KV blocks of 1048576 bytes need more memory than this device has"):
        BUDGET.num_blocks(4001)
    hybrid = msgspec.structs.replace(BUDGET, state_slot_bytes=MiB)  # the states must fit beside them
    assert hybrid.num_blocks(3996) == 3996
    with pytest.raises(ConfigError, match="need more memory"):
        hybrid.num_blocks(3997)


def test_snapshot_capacity_is_what_the_budget_holds_and_at_least_one() -> None:
    assert snapshot_capacity(512 * MiB, 50 * MiB, option="snapshot_mb") == 10
    assert snapshot_capacity(50 * MiB, 50 * MiB, option="snapshot_mb") == 1
    with pytest.raises(ConfigError, match=r"1 MiB holds no snapshot .*\(2097152 bytes each\)") as err:
        snapshot_capacity(MiB, 2 * MiB, option="snapshot_mb")
    assert err.value.field == "backend_options.snapshot_mb"
