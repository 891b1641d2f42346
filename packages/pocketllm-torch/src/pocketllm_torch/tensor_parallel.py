"""Tensor parallelism over torch.distributed: the rank group, how weights are split, and the step protocol.

Megatron's split of a decoder: q/k/v and gate/up are column-parallel (each rank computes its own heads and its
share of the MLP's intermediate features), o_proj and down_proj row-parallel (each rank multiplies its columns,
then one all-reduce sums the partial outputs), the embedding and the LM head vocab-parallel (each rank holds a
slice of the vocabulary: a lookup outside it adds zeros to the all-reduce; rank 0 gathers the logits). Heads go
to ranks whole with their query groups: with more ranks than KV heads there is nothing to split and the engine
refuses. A split may be uneven (the default model's 3 KV heads go 2 + 1 at TP=2), so each rank has its own
local config and KV-cache layout. 4- and 8-bit grouped matrices are split by rows, or by columns at group
boundaries, and stay grouped.

Rank 0 schedules and samples. Each step it broadcasts the step's inputs (one msgspec message: token ids,
positions, block tables, rows that sample) and every rank runs the same forward; the other ranks' worker loop
(:func:`serve`) returns when rank 0 sends the stop message at shutdown. Collectives use gloo on CPU and nccl
on CUDA (HCCL is an Ascend backend's own).
"""

from __future__ import annotations

import datetime
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from pocketllm.errors import UnsupportedOptionError
from pocketllm.tensor_parallel import rank_info
from pocketllm_torch.backend import NAME
from pocketllm_torch.groups import GROUP_SIZE, Int4Groups, Int8Groups

if TYPE_CHECKING:
    from pocketllm.model_config import ModelConfig
    from pocketllm_torch.linear import Linear

log = logging.getLogger(__name__)
Weight = np.ndarray | Int4Groups | Int8Groups
# Rank 0 may sit idle between requests for as long as it likes: the other ranks wait for its next step.
IDLE_TIMEOUT = datetime.timedelta(days=365)
TP_ARCHITECTURES = ("llama", "qwen3")
_LAYER = re.compile(r"model\.layers\.\d+\.(.+)\.(weight|bias)")


class Step(msgspec.Struct, array_like=True):
    """What every rank needs to run one forward pass as rank 0 does."""

    token_ids: list[int]
    starts: list[int]
    num_new_tokens: list[int]
    block_tables: list[list[int]]
    last_rows: list[int]  # rows whose logits rank 0 samples from


class Group:
    """This process's place in the tensor-parallel group, and the collectives the model and the runner use."""

    def __init__(self, device: torch.device, *, threads_chosen: bool) -> None:
        info = rank_info()
        if info is None:
            raise UnsupportedOptionError("tensor_parallel_size", NAME, "this process has no rank: launch it with "
                                         "torchrun, pocketllm-server's supervisor or the LLM class")
        self.rank, self.world_size = info.rank, info.world_size
        if device.type == "cpu" and not threads_chosen:  # the ranks on this machine share its cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.local_world_size))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                init_method=f"tcp://{info.master_addr}:{info.master_port}", rank=info.rank,
                                world_size=info.world_size, timeout=IDLE_TIMEOUT)
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
        """Rank 0: every rank's x [rows, n] side by side, in rank order; other ranks: None."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

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


@dataclass(frozen=True, slots=True)
class Split:
    """This rank's share of a model: its heads, KV heads, intermediate features and vocabulary rows."""

    heads: tuple[int, int]  # [first, end) of the query heads
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]  # real rows; the shard is padded to vocab_rows
    vocab_rows: int
    head_dim: int
    first: bool  # rank 0: keeps the row-parallel biases, added once

    @classmethod
    def of(cls, config: ModelConfig, rank: int, world_size: int, grouped: bool) -> Split:
        if config.architecture not in TP_ARCHITECTURES:
            raise UnsupportedOptionError("tensor_parallel_size", NAME, f"tensor parallelism runs "
                                         f"{', '.join(TP_ARCHITECTURES)}, not {config.architecture} yet")
        kv, heads, dim = config.num_key_value_heads, config.num_attention_heads, config.head_dim
        if kv < world_size:
            raise UnsupportedOptionError("tensor_parallel_size", NAME, f"{world_size} ranks, but the model has "
                                         f"only {kv} KV heads to split (replicating them is not implemented)")
        kv_range = _even(kv, world_size, rank, 1)
        group = heads // kv
        # Grouped matrices split their columns at group boundaries: a row-parallel shard is whole groups.
        align = GROUP_SIZE if grouped else 1
        if (dim * group) % align or config.intermediate_size % align:
            raise UnsupportedOptionError("tensor_parallel_size", NAME, f"o_proj's {dim * group} columns per KV "
                                         f"head or down_proj's {config.intermediate_size} do not split at the "
                                         f"{GROUP_SIZE}-column groups of its 4- and 8-bit matrices")
        per_rank = -(-config.vocab_size // world_size)
        vocab = (min(config.vocab_size, rank * per_rank), min(config.vocab_size, (rank + 1) * per_rank))
        return cls(heads=(kv_range[0] * group, kv_range[1] * group), kv_heads=kv_range,
                   intermediate=_even(config.intermediate_size // align, world_size, rank, align),
                   vocab=vocab, vocab_rows=per_rank, head_dim=dim, first=rank == 0)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        return msgspec.structs.replace(config, num_attention_heads=self.heads[1] - self.heads[0],
                                       num_key_value_heads=self.kv_heads[1] - self.kv_heads[0],
                                       intermediate_size=self.intermediate[1] - self.intermediate[0])

    def shard(self, weights: Iterable[tuple[str, Weight]]) -> Iterator[tuple[str, Weight]]:
        """This rank's part of each weight (Hugging Face names and layout: [out features, in features])."""
        d = self.head_dim
        for name, w in weights:
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                yield name, _pad_rows(_rows(w, *self.vocab), self.vocab_rows)
                continue
            match = _LAYER.fullmatch(name)
            module, kind = (match[1], match[2]) if match else ("", "")
            if module == "self_attn.q_proj":
                yield name, _rows(w, self.heads[0] * d, self.heads[1] * d)
            elif module in ("self_attn.k_proj", "self_attn.v_proj"):
                yield name, _rows(w, self.kv_heads[0] * d, self.kv_heads[1] * d)
            elif module in ("mlp.gate_proj", "mlp.up_proj"):
                yield name, _rows(w, *self.intermediate)
            elif module in ("self_attn.o_proj", "mlp.down_proj"):
                start, end = ((self.heads[0] * d, self.heads[1] * d) if module == "self_attn.o_proj"
                              else self.intermediate)
                yield name, _columns(w, start, end) if kind == "weight" else (w if self.first else w * 0)
            else:
                yield name, w  # norms: every rank needs them whole


def _even(total: int, parts: int, index: int, unit: int) -> tuple[int, int]:
    """Part ``index`` of ``total`` units split as evenly as possible, in elements of ``unit``."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return start * unit, (start + base + (index < extra)) * unit


def _rows(w: Weight, start: int, end: int) -> Weight:
    if isinstance(w, np.ndarray):
        return w[start:end]
    return type(w)(*(getattr(w, f)[start:end] for f in w.__dataclass_fields__))


def _columns(w: Weight, start: int, end: int) -> Weight:
    if isinstance(w, np.ndarray):
        return w[:, start:end]
    codes, *groups = (getattr(w, f) for f in w.__dataclass_fields__)
    return type(w)(codes[:, start:end], *(g[:, start // GROUP_SIZE:end // GROUP_SIZE] for g in groups))


def _pad_rows(w: Weight, rows: int) -> Weight:
    missing = rows - w.shape[0]
    if missing == 0:
        return w
    if isinstance(w, np.ndarray):
        return np.concatenate([w, np.zeros((missing, *w.shape[1:]), w.dtype)])
    return type(w)(*(np.concatenate([a, np.zeros((missing, *a.shape[1:]), a.dtype)])
                     for a in (getattr(w, f) for f in w.__dataclass_fields__)))


@dataclass(slots=True)
class AllReduced:
    """A row-parallel linear layer: this rank's partial product, summed over the ranks."""

    linear: Linear
    group: Group

    def __call__(self, x: Tensor) -> Tensor:
        return self.group.all_reduce(self.linear(x).contiguous())


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


def parallelize(model: object, split: Split, group: Group, vocab_size: int) -> None:
    """Wrap a model built from this rank's shards in the collectives that join it to the others."""
    for layer in model.layers:  # type: ignore[attr-defined]
        layer.attn.o_proj = AllReduced(layer.attn.o_proj, group)
        layer.mlp.down_proj = AllReduced(layer.mlp.down_proj, group)
    embed = model.embed_tokens  # type: ignore[attr-defined]
    model.embed_tokens = VocabParallelEmbedding(embed.weight, *split.vocab, group)  # type: ignore[attr-defined]
    model.lm_head = VocabParallelHead(model.lm_head, group, vocab_size)  # type: ignore[attr-defined]
