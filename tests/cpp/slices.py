"""Model.forward with each slice written as a (start, num_tokens, block_table, num_logits) tuple and the state
slots beside them: the tests' shorthand for typed SequenceSlices."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pocketllm_cpp import _native


def forward(model: Any, tokens: list[int], slices: Sequence[tuple[int, int, list[int], int]],
            state_slots: Sequence[int] = ()) -> np.ndarray:
    typed = [_native.SequenceSlice(start, n, list(table), int(logits)) for start, n, table, logits in slices]
    if state_slots:
        for part, slot in zip(typed, state_slots, strict=True):
            part.state_slot = slot
    return model.forward(tokens, typed)
