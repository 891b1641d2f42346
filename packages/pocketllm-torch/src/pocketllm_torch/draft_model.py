"""Drafting with a smaller model of the same vocabulary (``speculative_method="draft_model"``), for the model runner.

The draft model keeps keys and values of its own in a KV cache with as many blocks as the target's, indexed by
the same block tables: a sequence's blocks hold both models' entries for the same positions, and preemption and
freeing need nothing more. After each step, ``catch_up`` runs the draft model over the tokens the target computed
that it has not seen (prompt chunks as they run). Before a verification, ``draft`` runs it on the sequence's last
token and then on each draft in turn, for the drafts the scheduler made room for; those writes past the sequence
land in blocks the verification holds, and stay valid up to the last accepted draft (``DraftState.seen``).

Each draft is drawn as the target draws its token at that position, as the MTP head's are (mtp.py): the same
processing of the logits, the same seeded noise, so the target keeps it where its own draw is that token.

Draft models with state layers (Qwen3.5) are refused: their states would need slots and snapshots of their own.
A sequence admitted after a cached prefix runs its draft model over the prefix once (the request that computed the
prefix may not have drafted: a grammar's does not), rewriting those entries with the values they hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pocketllm.checkpoint import load_checkpoint
from pocketllm.errors import UnsupportedOptionError
from pocketllm.kv_budget import bytes_per_block
from pocketllm_torch import groups
from pocketllm_torch.attention import KVCache
from pocketllm_torch.cache_spec import AttentionSpec
from pocketllm_torch.models import model_class
from pocketllm_torch.name import NAME
from pocketllm_torch.speculative import fill_drafts, span_context

if TYPE_CHECKING:
    from pocketllm.checkpoint import Checkpoint
    from pocketllm_torch.config import TorchConfig
    from pocketllm_torch.sequence import Sequence
    from pocketllm_torch.speculative import DraftState


def open_draft_model(config: TorchConfig) -> Checkpoint:
    """The draft model's checkpoint (the core checked its vocabulary and storage against the target's)."""
    assert config.draft_model is not None
    return load_checkpoint(config.draft_model)


class ModelDrafter:
    """The draft model, loaded with the target's weights (so that a GPU's KV budget is what both left free), and
    its cache, allocated once the target's block count is known (``allocate``)."""

    def __init__(self, config: TorchConfig, checkpoint: Checkpoint, formats: groups.GroupFormats) -> None:
        model_config = checkpoint.config
        weights = ((t.name, groups.load(t, formats)) for t in checkpoint.tensors())
        self.model = model_class(model_config.architecture).from_weights(model_config, weights, config.device,
                                                                         config.dtype, config.max_model_len)
        self.specs = self.model.cache_specs
        if not all(isinstance(s, AttentionSpec) for s in self.specs):
            raise UnsupportedOptionError("draft_model", NAME, f"a draft model of {model_config.architecture!r} keeps "
                                         "state layers, which drafting does not run yet")
        self.config = config
        self.block_size = config.block_size
        self.chunk = config.prefill_chunk_size  # catch-up runs as the target's prefill does, a chunk at a time
        self.kv_cache: KVCache | None = None

    @property
    def bytes_per_block(self) -> int:
        """What one block of the draft model's cache holds."""
        spec = self.specs[0]
        return bytes_per_block(num_layers=len(self.specs), num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                               itemsize=self.config.kv_cache_dtype.itemsize, block_size=self.block_size)

    def allocate(self, num_blocks: int) -> None:
        spec = self.specs[0]
        self.kv_cache = KVCache(len(self.specs), num_blocks, self.block_size, spec.num_kv_heads, spec.head_dim,
                                self.config.kv_cache_dtype, self.config.device)

    @torch.inference_mode()
    def catch_up(self, ends: list[tuple[Sequence, int]]) -> None:
        """After a step: the draft model over each ``(sequence, its computed tokens now)``'s tokens it has not seen,
        as the target computes them (a cached prefix the first time, prefill_chunk_size tokens at a time)."""
        while spans := [(seq, _state(seq).seen, min(end - _state(seq).seen, self.chunk)) for seq, end in ends
                        if end > _state(seq).seen]:
            self._run([t for seq, start, n in spans for t in seq.token_ids[start:start + n]], spans)
            for seq, start, n in spans:
                _state(seq).seen = start + n

    @torch.inference_mode()
    def draft(self, seqs: list[Sequence]) -> None:
        """Fill in the drafts of these decoding sequences (see speculative.fill_drafts): the draft model on each
        one's last token, then on each draft."""
        def logits_of(j: int, active: list[Sequence]) -> torch.Tensor:
            tokens = [seq.token_ids[-1] if j == 0 else seq.draft[j - 1] for seq in active]
            hidden = self._run(tokens, [(seq, seq.num_tokens - 1 + j, 1) for seq in active])
            for seq in active:
                _state(seq).seen = seq.num_tokens  # through its last token; the drafts' entries wait for verification
            return self.model.compute_logits(hidden)

        fill_drafts(seqs, logits_of)

    def _run(self, token_ids: list[int], spans: list[tuple[Sequence, int, int]]) -> torch.Tensor:
        assert self.kv_cache is not None  # allocated with the target's
        ctx = span_context(spans, self.kv_cache, list(self.kv_cache.layers), self.block_size, self.model.dtype)
        return self.model(torch.tensor(token_ids, device=self.kv_cache.blocks.device), ctx)


def _state(seq: Sequence) -> DraftState:
    assert seq.spec is not None
    return seq.spec
