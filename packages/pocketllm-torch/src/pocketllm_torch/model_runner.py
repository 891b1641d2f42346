"""Owns the model and its KV cache; turns a scheduled batch into one forward pass and sampled tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pocketllm_torch import groups
from pocketllm_torch.attention import KVCache, build_metadata
from pocketllm_torch.decode_graphs import DecodeGraphs
from pocketllm_torch.linear import uses_int4, uses_int8
from pocketllm_torch.models.llama import LlamaModel
from pocketllm_torch.sampler import Outcome, sample_each

if TYPE_CHECKING:
    from pocketllm.checkpoint import Checkpoint
    from pocketllm_torch.config import TorchConfig
    from pocketllm_torch.scheduler import ScheduledBatch



class ModelRunner:
    def __init__(self, config: TorchConfig, checkpoint: Checkpoint) -> None:
        self.device = config.device
        self.block_size = config.block_size
        int4, int8 = uses_int4(config.device, config.dtype), uses_int8(config.device)
        weights = ((t.name, groups.load(t, int4=int4, int8=int8)) for t in checkpoint.tensors())
        self.model = LlamaModel.from_weights(config.model, weights, config.device, config.dtype, config.max_model_len)
        # Sized after the weights are loaded, so a GPU's budget is what they left free.
        self.num_kv_blocks = config.resolve_num_kv_blocks()
        m = config.model
        # One spare block up front is the null block that padding reads.
        self.kv_cache = KVCache(m.num_hidden_layers, self.num_kv_blocks + 1, self.block_size, m.num_key_value_heads,
                                m.head_dim, config.kv_cache_dtype, self.device)
        self.decode_graphs = DecodeGraphs(self.model, self.kv_cache) if config.decode_graphs else None

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[Outcome | None]:
        """Run the batch's new tokens; sample for each sequence whose last pending token ran (None otherwise).

        A sequence that could not be sampled gets a SamplingFailure instead of its token."""
        token_ids: list[int] = []
        starts: list[int] = []
        last_rows: list[int] = []  # row of the last token of each sequence that samples
        samplers: list[int] = []  # those sequences' indices in the batch
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            token_ids += seq.token_ids[start:start + n]
            starts.append(start)
            if start + n == seq.num_tokens:
                last_rows.append(len(token_ids) - 1)
                samplers.append(i)
        block_tables = [seq.block_table for seq in batch.seqs]
        self.kv_cache.zero_new_blocks(block_tables)
        positions, meta = build_metadata(starts, batch.num_new_tokens, block_tables, self.block_size, self.device,
                                         self.model.dtype)
        input_ids = torch.tensor(token_ids, device=self.device)
        if self.decode_graphs is not None and meta.query_index is None:
            hidden = self.decode_graphs(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, self.kv_cache.layers, meta)
        results: list[Outcome | None] = [None] * len(batch.seqs)
        if not samplers:
            return results
        # Only the last token of a sequence needs logits: the lm_head is the largest matrix in small models.
        if len(last_rows) < len(token_ids):
            hidden = hidden[torch.tensor(last_rows, device=self.device)]
        outcomes = sample_each(self.model.compute_logits(hidden), [batch.seqs[i] for i in samplers])
        for i, outcome in zip(samplers, outcomes, strict=True):
            results[i] = outcome
        return results
