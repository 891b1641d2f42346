"""A checkpoint's weights as a model's loader takes them: each by name exactly once, none left unused."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from pocketllm.errors import CheckpointError
from pocketllm_torch.groups import Fp8Groups, Groups, Int4Groups, Int8Groups
from pocketllm_torch.linear import AnyWeight, Fp8Weight, Int4Weight, Int8Weight, Linear, concat_rows, make_linear

if TYPE_CHECKING:
    import numpy as np

GROUPED = {Int4Groups: Int4Weight.from_groups, Int8Groups: Int8Weight.from_groups, Fp8Groups: Fp8Weight.from_groups}
Weight = AnyWeight


class Weights:
    """Named weights, stored in ``dtype``; 4- and 8-bit and FP8 matrices (:class:`~pocketllm_torch.groups.Groups`) stay
    so where a kernel reads them. ``layout(name, weight)`` reorders a weight as the model computes with it."""

    def __init__(self, weights: Iterable[tuple[str, np.ndarray | Groups]], device: torch.device,
                 dtype: torch.dtype, *, ignored: re.Pattern[str] | None = None,
                 layout: Callable[[str, Weight], Weight] = lambda name, weight: weight) -> None:
        self.tensors: dict[str, Weight] = {
            name: GROUPED[type(w)](w) if type(w) in GROUPED else torch.tensor(w, dtype=dtype)
            for name, w in weights if ignored is None or not ignored.match(name)}
        self.device, self.dtype, self.layout = device, dtype, layout

    def take(self, name: str) -> Weight:
        if name not in self.tensors:
            raise CheckpointError(f"checkpoint has no weight {name!r}")
        return self.layout(name, self.tensors.pop(name))

    def pop(self, name: str) -> Weight | None:
        """A weight the checkpoint may lack (a tied lm_head)."""
        return self.take(name) if name in self.tensors else None

    def has(self, name: str) -> bool:
        return name in self.tensors

    def dense(self, name: str) -> Tensor:
        return dense(self.take(name), self.dtype)

    def linear(self, names: Iterable[str], biases: Iterable[str] = ()) -> Linear:
        """One linear layer over the rows of several weights (q/k/v, gate/up): one matmul instead of several."""
        weight = concat_rows([self.take(name) for name in names])
        bias = [self.dense(name) for name in biases]
        return make_linear(weight, torch.cat(bias) if bias else None, self.device, self.dtype)

    def finish(self) -> None:
        if self.tensors:
            raise CheckpointError(f"checkpoint has weights this model does not use: {sorted(self.tensors)[:5]}")


def dense(weight: Weight, dtype: torch.dtype) -> Tensor:
    return weight if isinstance(weight, Tensor) else weight.dequantize().to(dtype)
