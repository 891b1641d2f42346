"""Decode steps replayed from TorchScript traces: the CPU's counterpart of CUDA graphs.

A decode step of a small model is ~1,500 small kernels, and issuing each one from Python costs about as much
as running it. A trace of the whole forward, replayed by TorchScript's C++ interpreter, issues the same kernels
without the Python (measured: a SmolLM2-135M decode forward 24 -> 17.5 ms on 2 cores).

A trace is a straight-line recording, so it bakes in every Python branch taken while recording: the decode
branch of attention (one query per sequence) and each linear layer's kernel choice for that number of rows,
which ``linear.kernel_key`` names. Sizes read from tensors are recorded as size ops, so one trace serves every
batch size with the same kernel choices and every context length. Steps that prefill stay eager: they are few
and dominated by large matmuls. So do batch sizes whose kernels cannot be traced (oneDNN's prepacked linear
takes an argument the tracer does not support): the first such step is tried once, then run eagerly. Models with
state layers pass their state slots and pools as inputs; MoE models are not traced (routing steers Python).
"""

from __future__ import annotations

import logging
import warnings
from typing import TYPE_CHECKING

import torch

from pocketllm_torch.attention import AttentionMetadata
from pocketllm_torch.context import StepContext
from pocketllm_torch.linear import kernel_key
from pocketllm_torch.state_cache import LayerState

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import Tensor

    from pocketllm_torch.models.llama import LlamaModel
    from pocketllm_torch.state_cache import StateCache


class DecodeGraphs:
    def __init__(self, model: LlamaModel, caches: list[Tensor | LayerState], state_cache: StateCache | None) -> None:
        self.model = model
        self.caches = caches
        self.state_cache = state_cache
        self.traces: dict[tuple[bool, ...], Callable[..., Tensor] | None] = {}  # None: cannot be traced

    def __call__(self, input_ids: Tensor, ctx: StepContext) -> Tensor:
        """The model's hidden states for a decode step (``ctx.is_decode``); fills the KV cache."""
        meta = ctx.attention
        args = (input_ids, ctx.positions, meta.slot_mapping, meta.context_blocks, meta.context_lens, meta.mask)
        if ctx.state_slots is not None and self.state_cache is not None:
            # The state pools are inputs, not constants: a trace drops in-place writes to a constant that nothing
            # reads afterwards, and a step's new states are read only by the next step.
            args += (ctx.state_slots, self.state_cache.conv, self.state_cache.recurrent)
        key = kernel_key(input_ids.shape[0])
        if key not in self.traces:
            self.traces[key] = self._record(args, ctx.state_slots)
        trace = self.traces[key]
        return self._forward(*args) if trace is None else trace(*args)

    def _record(self, args: tuple[Tensor, ...], slots: Tensor | None) -> Callable[..., Tensor] | None:
        """A recording runs the step once, and the step then runs again: writing the same keys and values twice
        is harmless, but a state layer would advance twice, so the step's states (``slots``) are put back."""
        state = self.state_cache if slots is not None else None
        saved = (state.conv[:, slots].clone(), state.recurrent[:, slots].clone()) if state is not None else None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # TracerWarnings for exactly the branches the key names
                return torch.jit.trace(self._forward, args, check_trace=False)
        except RuntimeError as e:
            log.info("decode steps of %d sequences run eagerly: their kernels cannot be traced (%s)",
                     args[0].shape[0], e)
            return None
        finally:
            if state is not None and saved is not None:
                state.conv[:, slots], state.recurrent[:, slots] = saved

    def _forward(self, input_ids: Tensor, positions: Tensor, slot_mapping: Tensor, context_blocks: Tensor,
                 context_lens: Tensor, mask: Tensor, *state: Tensor) -> Tensor:
        meta = AttentionMetadata(slot_mapping, context_blocks, context_lens, mask, None, None)
        if not state:
            return self.model(input_ids, StepContext(positions, meta, self.caches, [], None))
        slots, conv, recurrent = state
        pools = iter(zip(conv.unbind(0), recurrent.unbind(0), strict=True))
        caches = [LayerState(*next(pools)) if isinstance(c, LayerState) else c for c in self.caches]
        return self.model(input_ids, StepContext(positions, meta, caches, [], slots))
