"""Tensor parallelism over torch.distributed: the rank group, the step protocol and the model's collectives.

Megatron's split of a decoder: q/k/v and gate/up are column-parallel (each rank computes its own heads and its
share of the MLP's intermediate features), o_proj and down_proj row-parallel (each rank multiplies its columns,
then one all-reduce sums the partial outputs), the embedding and the LM head vocab-parallel (each rank holds a
slice of the vocabulary: a lookup outside it adds zeros to the all-reduce; rank 0 gathers the logits). Heads go
to ranks whole with their query groups: with more ranks than KV heads there is nothing to split and the engine
refuses. A split may be uneven (the default model's 3 KV heads go 2 + 1 at TP=2), so each rank has its own
local config and KV-cache layout; weight_split.py says which part of each weight a rank holds (Gated DeltaNet
layers are split by their heads too, and experts by their intermediate features).

Rank 0 schedules and samples. Each step it broadcasts the step's inputs (one msgspec message: token ids,
positions, block tables, rows that sample, and for hybrid models the state slots to reset, the prefix-cache
snapshots to file or restore) and every rank runs the same forward; the other ranks' worker loop
(``ModelRunner.serve``) returns when rank 0 sends the stop message at shutdown. Collectives use gloo on CPU, and the
platform's backend for device tensors (nccl on CUDA, HCCL on pocketllm-ascend's NPUs).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from pocketllm.errors import UnsupportedOptionError
from pocketllm.tensor_parallel import launch_abandoned, rank_info
from pocketllm_torch.config import default_threads
from pocketllm_torch.linear import GroupedLinear
from pocketllm_torch.name import NAME

if TYPE_CHECKING:
    from pocketllm_torch.linear import Linear
    from pocketllm_torch.platform import Platform
    from pocketllm_torch.weight_split import Split

# Rank 0 may sit idle between requests for as long as it likes: the other ranks wait for its next step.
IDLE_TIMEOUT = datetime.timedelta(days=365)
JOIN_POLL = datetime.timedelta(seconds=0.5)


class Step(msgspec.Struct, array_like=True):
    """What every rank needs to run one forward pass as rank 0 does."""

    token_ids: list[int]
    starts: list[int]
    num_new_tokens: list[int]
    block_tables: list[list[int]]
    last_rows: list[int]  # rows whose logits rank 0 samples from
    # Hybrid models: each sequence's state slot; those starting from their first token; (prefix hash, slot)
    # snapshots to restore; where inside prompt chunks to capture states; and the snapshots rank 0 filed after
    # the step before, to file here first: (prefix hash, slot) of chunk ends, (prefix hash, index) of captures.
    state_slots: list[int] | None = None
    fresh_slots: list[int] = []
    restores: list[tuple[int, int]] = []
    capture_points: list[list[int]] | None = None
    slot_saves: list[tuple[int, int]] = []
    capture_saves: list[tuple[int, int]] = []
    # Speculative decoding: the sequences (batch indices) whose rows verify drafts, whose state layers keep their
    # state after each row; and the verifications of the step before to commit first: (slot, index, rows kept).
    verifying: list[int] = []
    state_commits: list[tuple[int, int, int]] = []


class Group:
    """This process's place in the tensor-parallel group, and the collectives the model and the runner use."""

    def __init__(self, platform: Platform, *, threads_chosen: bool) -> None:
        info = rank_info()
        if info is None:
            raise UnsupportedOptionError("tensor_parallel_size", NAME, "this process has no rank: launch it with "
                                         "torchrun, pocketllm-server's supervisor or the LLM class")
        self.rank, self.world_size, self.local_world_size = info.rank, info.world_size, info.local_world_size
        if platform.ranks_share_memory and not threads_chosen:  # the ranks here share the CPUs it may use
            torch.set_num_threads(max(1, default_threads() // info.local_world_size))
        store = dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_master=info.rank == 0,
                              timeout=IDLE_TIMEOUT, wait_for_workers=False)
        # Every rank checks in; the wait gives up once the launcher says a rank died before it could.
        store.set(f"pocketllm/joined/{info.rank}", "1")
        joined = [f"pocketllm/joined/{r}" for r in range(info.world_size)]
        while True:
            try:
                store.wait(joined, JOIN_POLL)
                break
            except RuntimeError:  # DistStoreError: not all there yet
                if launch_abandoned():
                    raise RuntimeError("the other tensor-parallel ranks never joined") from None
        # The step messages and the KV-block count are CPU tensors (gloo); activations go through the device's
        # collective backend (nccl on CUDA).
        dist.init_process_group(platform.process_group_backend(), store=store,
                                rank=info.rank, world_size=info.world_size, timeout=IDLE_TIMEOUT)
        self._decoder = msgspec.msgpack.Decoder(Step)
        self._encoder = msgspec.msgpack.Encoder()

    def all_reduce(self, x: Tensor) -> Tensor:
        dist.all_reduce(x)
        return x

    def min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t)

    def gather_columns(self, x: Tensor) -> Tensor | None:
        """Rank 0: every rank's x [rows, n] side by side, in rank order; other ranks: None. An all-gather, not a
        gather: HCCL has no gather (gloo and nccl have both)."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def send(self, step: Step | None) -> None:
        """Rank 0: the step every rank runs next (None: stop)."""
        payload = b"" if step is None else self._encoder.encode(step)
        dist.broadcast(torch.tensor([len(payload) if step is not None else -1], dtype=torch.int64), src=0)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0)

    def receive(self) -> Step | None:
        """Other ranks: rank 0's next step, or None when it has shut down."""
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, src=0)
        if int(size) < 0:
            return None
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(payload, src=0)
        return self._decoder.decode(payload.numpy().tobytes())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass(slots=True)
class AllReduced:
    """A row-parallel linear layer: this rank's partial product, summed over the ranks in float32 and rounded to
    the activations' dtype once, as one rank's kernel rounds its whole sum (bf16 partials would round twice)."""

    linear: Linear
    group: Group

    def __call__(self, x: Tensor) -> Tensor:
        return self.group.all_reduce(self.linear(x).float().contiguous()).to(x.dtype)


@dataclass(slots=True)
class VocabParallelEmbedding:
    weight: Tensor  # this rank's rows [vocab_rows, hidden]
    start: int
    end: int
    group: Group

    def __call__(self, ids: Tensor) -> Tensor:
        mine = (ids >= self.start) & (ids < self.end)
        x = F.embedding(torch.where(mine, ids - self.start, 0), self.weight) * mine.unsqueeze(-1)
        return self.group.all_reduce(x)


@dataclass(slots=True)
class VocabParallelHead:
    """The LM head over this rank's vocabulary rows; rank 0 gets the whole vocabulary's logits."""

    linear: Linear
    group: Group
    vocab_size: int

    def __call__(self, x: Tensor) -> Tensor:
        logits = self.group.gather_columns(self.linear(x))
        return logits[:, :self.vocab_size] if logits is not None else x.new_empty(0)


def parallelize(model: Any, split: Split, group: Group, vocab_size: int) -> None:
    """Wrap a model built from this rank's shards in the collectives that join it to the others."""
    for layer in model.layers:
        mixer = getattr(layer, "attn", None) or layer.mixer
        if hasattr(mixer, "o_proj"):  # attention
            mixer.o_proj = AllReduced(_float32_outputs(mixer.o_proj), group)
        else:  # Gated DeltaNet
            mixer.out_proj = AllReduced(_float32_outputs(mixer.out_proj), group)
        if hasattr(layer.mlp, "down_proj"):
            layer.mlp.down_proj = AllReduced(_float32_outputs(layer.mlp.down_proj), group)
        else:  # experts and the shared expert: their partial outputs sum once
            layer.mlp = AllReduced(layer.mlp, group)
    model.embed_tokens = VocabParallelEmbedding(model.embed_tokens.weight, *split.vocab, group)
    model.lm_head = VocabParallelHead(model.lm_head, group, vocab_size)


def _float32_outputs(linear: Linear) -> Linear:
    """The layer with its 4- or 8-bit kernel's outputs kept in float32 for the sum over the ranks."""
    if isinstance(linear, GroupedLinear):
        linear.out_dtype = torch.float32
    return linear
