"""Owns the model and its caches; turns a scheduled batch into one forward pass and sampled tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pocketllm.kv_budget import snapshot_capacity
from pocketllm_torch import groups, platform
from pocketllm_torch.attention import KVCache, build_metadata
from pocketllm_torch.cache_spec import AttentionSpec, StateSpec
from pocketllm_torch.context import StepContext
from pocketllm_torch.decode_graphs import DecodeGraphs
from pocketllm_torch.draft_model import ModelDrafter, open_draft_model
from pocketllm_torch.linear import group_formats
from pocketllm_torch.models import model_class, mtp_class
from pocketllm_torch.mtp import MTPDrafter
from pocketllm_torch.sampler import Outcome, compute_logprobs, sample_each
from pocketllm_torch.speculative import DraftRow
from pocketllm_torch.state_cache import StateCache
from pocketllm_torch.state_snapshots import StateSnapshots
from pocketllm_torch.tensor_parallel import Step, parallelize
from pocketllm_torch.weight_split import Split

if TYPE_CHECKING:
    from pocketllm.checkpoint import Checkpoint
    from pocketllm_torch.config import TorchConfig
    from pocketllm_torch.scheduler import ScheduledBatch
    from pocketllm_torch.sequence import Sequence
    from pocketllm_torch.state_cache import LayerState
    from pocketllm_torch.tensor_parallel import Group


# The most memory one step's verifications may hold in kept states (a 19 MB state of Qwen3.5-0.8B, 64 sequences
# drafting 16 tokens: 19 GB otherwise); drafts past it wait for a later step.
VERIFY_STATE_BYTES = 256 << 20
# The most memory one step's scored prompt rows (prompt_logprobs) may take in logits: a row is a whole vocabulary
# (1 MB of float32 for Qwen3.5's 248k), and 2,048 a step would be 2 GB; prompt chunks past it wait. At least
# MIN_SCORED_ROWS a step.
SCORED_LOGITS_BYTES = 256 << 20
MIN_SCORED_ROWS = 256


class ModelRunner:
    def __init__(self, config: TorchConfig, checkpoint: Checkpoint, tp: Group | None = None) -> None:
        self.device = config.device
        platform.activate(config.platform)  # its fused operators and sampling noise, for the models and sampler
        self.block_size = config.block_size
        self.tp = tp
        # Scored prompt rows one step may hold: SCORED_LOGITS_BYTES of float32 logits.
        self.scored_rows_per_step = max(MIN_SCORED_ROWS, SCORED_LOGITS_BYTES // (4 * config.model.vocab_size))
        formats = group_formats(config.device, config.dtype)
        weights = ((t.name, groups.load(t, formats)) for t in checkpoint.tensors())
        model_config = config.model
        split = None
        if tp is not None:
            split = Split.of(config.model, tp.rank, tp.world_size, tiled_values=checkpoint.format == "gguf")
            model_config, weights = split.local_config(config.model), split.shard(weights)
        model_cls = model_class(config.model.architecture)
        self.model = model_cls.from_weights(model_config, weights, config.device, config.dtype, config.max_model_len)
        if tp is not None and split is not None:
            parallelize(self.model, split, tp, config.model.vocab_size)
        specs = self.model.cache_specs
        # The multi-token-prediction head's layer keeps keys and values too: the cache's last layer.
        head = None
        if config.speculative_method == "mtp":
            head = mtp_class(config.model.architecture).from_weights(
                config.model, ((t.name, groups.load(t, formats)) for t in checkpoint.mtp_tensors()),
                self.model, config.device, config.dtype)
            specs = [*specs, head.cache_spec]
        attention = [s for s in specs if isinstance(s, AttentionSpec)]
        states = [s for s in specs if isinstance(s, StateSpec)]
        # Sized after the weights are loaded, so a GPU's budget is what they left free.
        self.state_cache = (StateCache(len(states), config.max_num_seqs, states[0], self.model.dtype, self.device)
                            if states else None)
        state_bytes = StateCache.bytes_per_slot(len(states), states[0], self.model.dtype) if states else 0
        # Verifications keep the state after each row (for the accepted one): rows per step within a budget.
        self.verify_state_rows = VERIFY_STATE_BYTES // state_bytes if states else None
        # The snapshots' budget is memory they may come to hold: it is not the KV cache's to take.
        snapshot_bytes = config.state_snapshot_bytes if states and config.enable_prefix_caching else 0
        # A draft model's cache has as many blocks as the target's: the same block tables index both.
        draft = (ModelDrafter(config, open_draft_model(config), formats)
                 if config.speculative_method == "draft_model" else None)
        self.num_kv_blocks = config.resolve_num_kv_blocks(
            len(attention), state_bytes, snapshot_bytes, ranks_here=tp.local_world_size if tp else 1,
            draft_bytes_per_block=draft.bytes_per_block if draft is not None else 0)
        if tp is not None:  # every rank holds the same blocks: as many as the tightest rank can
            self.num_kv_blocks = tp.min(self.num_kv_blocks)
        # One spare block up front is the null block that padding reads.
        spec = attention[0]
        self.kv_cache = KVCache(len(attention), self.num_kv_blocks + 1, self.block_size, spec.num_kv_heads,
                                spec.head_dim, config.kv_cache_dtype, self.device)
        # Each layer's cache, in layer order: its KV view or its state slots.
        kv_layers, state_layers = iter(self.kv_cache.layers), iter(self.state_cache.layers if states else [])
        self.caches: list[torch.Tensor | LayerState] = [
            next(kv_layers) if isinstance(s, AttentionSpec) else next(state_layers) for s in self.model.cache_specs]
        self.drafter: MTPDrafter | ModelDrafter | None = None  # drafts by a model: filled in after scheduling
        if head is not None:
            self.drafter = MTPDrafter(head, self.kv_cache, self.block_size)
        elif draft is not None:
            draft.allocate(self.num_kv_blocks + 1)
            self.drafter = draft
        # MTP: the last step's final hidden states, and where each sequence's rows began and how many ran.
        self._hidden: torch.Tensor | None = None
        self._ran: list[tuple[int, int]] = []
        self.snapshots: StateSnapshots | None = None
        self._captured: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # states inside the last step's chunks
        self._capture_ends: list[tuple[Sequence, int]] = []  # rank 0: whose they are, and where
        self._pending_saves: tuple[list[tuple[int, int]], list[tuple[int, int]]] = [], []
        # Verifications: the states after each row of the last step's (index in its batch, rows) and the
        # (slot, index, rows) of those to commit at the start of the next.
        self._kept: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._pending_commits: list[tuple[int, int, int]] = []
        if states and config.enable_prefix_caching:
            # Every rank files and evicts the same snapshots: as many as the rank with the largest states holds (all
            # of them agree, so that all refuse together when none fits).
            largest = -tp.min(-state_bytes) if tp is not None else state_bytes
            self.snapshots = StateSnapshots(snapshot_capacity(config.state_snapshot_bytes, largest,
                                                                option="state_snapshot_mb"))
        # A trace would freeze the collectives of a tensor-parallel step: those run eagerly.
        self.decode_graphs = (DecodeGraphs(self.model, self.caches, self.state_cache)
                              if config.decode_graphs and self.model.traceable and tp is None else None)

    def _capture_points(self, batch: ScheduledBatch) -> list[list[int]] | None:
        """Where inside each prompt chunk the state layers keep states for snapshots: block boundaries that fall
        on the model's capture interval, before the chunk's end (whose states the slots hold anyway)."""
        if self.snapshots is None:
            return None
        every = self.model.STATE_CAPTURE_INTERVAL
        return [[p for p in range(every, n, every)
                 if (seq.num_computed_tokens + p) % self.block_size == 0
                 and seq.num_computed_tokens + p <= seq.num_prompt_tokens]
                for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]

    @torch.inference_mode()
    def save_snapshots(self, batch: ScheduledBatch) -> None:
        """After a step and its blocks' hashes (rank 0): file the states at the block boundaries its prompt chunks
        reached. The other ranks file theirs at the start of the next step, which names them."""
        if self.snapshots is None or self.state_cache is None:
            return
        capture_saves = [(seq.block_hashes[end // self.block_size - 1], i)
                         for i, (seq, end) in enumerate(self._capture_ends)]
        slot_saves = []
        for seq in batch.seqs:  # each chunk's end
            blocks, partial = divmod(seq.num_computed_tokens, self.block_size)
            if blocks and not partial and seq.num_computed_tokens <= seq.num_prompt_tokens:
                slot_saves.append((seq.block_hashes[blocks - 1], seq.state_slot))
        self._file_snapshots(slot_saves, capture_saves)
        self._pending_saves = slot_saves, capture_saves

    def _file_snapshots(self, slot_saves: list[tuple[int, int]], capture_saves: list[tuple[int, int]]) -> None:
        assert self.snapshots is not None and self.state_cache is not None
        for key, i in capture_saves:
            conv, recurrent = (torch.stack(parts) for parts in zip(*self._captured[i], strict=True))
            self.snapshots.save(key, conv, recurrent)
        self._captured = []
        for key, slot in slot_saves:
            self.snapshots.save(key, self.state_cache.conv[:, slot], self.state_cache.recurrent[:, slot])

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[list[Outcome] | list[float] | None]:
        """Run the batch's new tokens; sample for each sequence whose last own token ran (a row for it, and one
        per draft that ran after it: see speculative.py), or give an embedding request whose prompt ran its
        embedding (None for the others).

        A row that could not be sampled gets a SamplingFailure instead of its token."""
        if self.drafter is not None:  # the drafts the scheduler made room for (a prompt chunk runs none)
            self.drafter.draft([seq for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
                            if seq.num_computed_tokens + n > seq.num_tokens])
        token_ids: list[int] = []
        starts: list[int] = []
        last_rows: list[int] = []  # rows whose logits are sampled
        rows: list[DraftRow] = []  # what each of them is sampled as
        samplers: list[tuple[int, int]] = []  # index in the batch and number of rows of each sampling sequence
        poolers: list[tuple[int, int]] = []  # embedding requests: index in the batch, first row of its chunk
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            start = seq.num_computed_tokens
            token_ids += seq.step_token_ids(start, n)
            starts.append(start)
            if seq.pooling is not None:
                poolers.append((i, len(token_ids) - n))
            elif start + n >= seq.num_tokens:
                drafted = start + n - seq.num_tokens
                last_rows += range(len(token_ids) - 1 - drafted, len(token_ids))
                rows += [DraftRow(seq, j) for j in range(drafted + 1)]
                samplers.append((i, drafted + 1))
        scored = self._prompt_rows(batch, starts)
        step = Step(token_ids, starts, list(batch.num_new_tokens), [seq.block_table for seq in batch.seqs],
                    last_rows + [row for _, row, _ in scored])
        self._ran = list(zip(starts, batch.num_new_tokens, strict=True))  # before verifications keep fewer rows
        if self.state_cache is not None:
            step.state_slots = [seq.state_slot for seq in batch.seqs]
            # New, or recomputing after preemption: their states start from zero.
            step.fresh_slots = [slot for slot, start in zip(step.state_slots, starts, strict=True) if start == 0]
            if self.snapshots is not None:  # admitted after a cached prefix: its states where that prefix ends
                step.restores = [(seq.resume_from, seq.state_slot) for seq in batch.seqs
                                 if seq.resume_from is not None]
                step.capture_points = self._capture_points(batch)
                step.slot_saves, step.capture_saves = self._pending_saves
                self._pending_saves = [], []
            for seq in batch.seqs:
                seq.resume_from = None
            step.verifying = [i for i, count in samplers if count > 1]
            step.state_commits, self._pending_commits = self._pending_commits, []
        if self.tp is not None:
            self.tp.send(step)
        logits, hidden, ctx = self.forward(step)
        if isinstance(self.drafter, MTPDrafter):
            self._hidden = hidden
        # Filed by save_snapshots once the blocks they end have their hashes.
        self._capture_ends = [(batch.seqs[i], batch.seqs[i].num_computed_tokens + p) for i, p in ctx.captured]
        results: list[list[Outcome] | list[float] | None] = [None] * len(batch.seqs)
        for i, row in poolers:
            results[i] = self._pool(batch.seqs[i], hidden[row:row + batch.num_new_tokens[i]])
        if logits is None:
            return results
        if scored:
            self._score_prompts(logits[len(last_rows):], scored)
        outcomes = iter(sample_each(logits[:len(last_rows)], rows) if rows else [])
        for i, count in samplers:
            results[i] = [next(outcomes) for _ in range(count)]
        return results

    @staticmethod
    def _prompt_rows(batch: ScheduledBatch, starts: list[int]) -> list[tuple[Sequence, int, int]]:
        """The rows whose logits score a prompt token (see pocketllm.backend, "Prompt logprobs"): (sequence, row,
        the prompt token it scores), for the prompt positions this step runs that are not scored yet."""
        scored, first_row = [], 0
        for seq, start, n in zip(batch.seqs, starts, batch.num_new_tokens, strict=True):
            first = max(start, len(seq.prompt_logprobs))
            for position in range(first, first + seq.scored_rows(start, n)):
                scored.append((seq, first_row + position - start, seq.token_ids[position + 1]))
            first_row += n
        return scored

    @staticmethod
    def _score_prompts(logits: torch.Tensor, scored: list[tuple[Sequence, int, int]]) -> None:
        """Each scored row's prompt token, by the raw logits (no sampling parameter applies), in prompt order."""
        targets = torch.tensor([token for _, _, token in scored], device=logits.device)
        ks = [seq.params.prompt_logprobs or 0 for seq, _, _ in scored]
        for (seq, _, _), lp in zip(scored, compute_logprobs(logits.float(), targets, ks), strict=True):
            seq.prompt_logprobs.append(lp)

    def commit_states(self, batch: ScheduledBatch) -> None:
        """After a step's verifications were accepted (``batch.num_new_tokens`` shrunk to the rows kept): each
        verifying sequence's state layers take their state after its last kept row, at the start of the next
        step, on every rank (each kept its own states in this step's forward)."""
        if self.state_cache is None:
            return
        for i, seq in enumerate(batch.seqs):
            kept = batch.num_new_tokens[i]
            if (i, kept) in self._kept and seq.state_slot is not None:
                self._pending_commits.append((seq.state_slot, i, kept))

    def catch_up(self, batch: ScheduledBatch, done: list[Sequence]) -> None:
        """After a step, before its tokens are marked computed (``batch.num_new_tokens`` the rows it kept): the
        drafting model (the MTP head or the draft model) runs over the kept rows of the sequences that go on
        generating (see mtp.py, draft_model.py)."""
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.catch_up([(seq, start + n) for seq, (start, _), n in
                                   zip(batch.seqs, self._ran, batch.num_new_tokens, strict=True)
                                   if seq.spec is not None and seq not in done])
        if not isinstance(self.drafter, MTPDrafter) or self._hidden is None:
            return
        # Every generating sequence, drafting or not (a grammar's): the head's keys and values of the blocks it
        # files in the prefix cache are then there for the requests that reuse them.
        kept, first = [], 0
        for seq, (start, ran), n in zip(batch.seqs, self._ran, batch.num_new_tokens, strict=True):
            if seq.pooling is None and seq not in done:
                kept.append((seq, start, self._hidden[first:first + n]))
            first += ran
        self._hidden = None
        self.drafter.catch_up(kept)

    def _pool(self, seq: Sequence, rows: torch.Tensor) -> list[float] | None:
        """Fold an embedding request's chunk of final hidden states into its pooling; its embedding once its
        prompt is done (see pocketllm.backend.EmbeddingEngine)."""
        assert seq.pooling is not None
        kind, start = seq.pooling.pooling_type, seq.num_computed_tokens
        done = start + len(rows) == seq.num_tokens
        if kind == "mean":
            part = self.model.norm(rows).float().sum(0)
            seq.pooled = part if start == 0 or seq.pooled is None else seq.pooled + part
        elif kind == "cls" and start == 0:
            seq.pooled = self.model.norm(rows[:1]).float()[0]
        elif kind == "last" and done:
            seq.pooled = self.model.norm(rows[-1:]).float()[0]
        if not done:
            return None
        assert seq.pooled is not None
        vector = seq.pooled / seq.num_tokens if kind == "mean" else seq.pooled
        if seq.pooling.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        return vector.tolist()

    @torch.inference_mode()
    def forward(self, step: Step) -> tuple[torch.Tensor | None, torch.Tensor, StepContext]:
        """The step's forward pass, on every rank: the logits of ``step.last_rows`` (None where no row samples,
        and on ranks other than 0), every row's final hidden state before the last norm, and the step's context."""
        slots = None
        if self.state_cache is not None and step.state_slots is not None:
            if self.tp is not None and self.tp.rank > 0 and self.snapshots is not None:
                self._file_snapshots(step.slot_saves, step.capture_saves)
            slots = torch.tensor(step.state_slots, device=self.device)
            for slot, i, kept in step.state_commits:
                conv, recurrent = (torch.stack(parts) for parts in zip(*self._kept[(i, kept)], strict=True))
                self.state_cache.conv[:, slot] = conv
                self.state_cache.recurrent[:, slot] = recurrent
            if step.fresh_slots:
                self.state_cache.reset(torch.tensor(step.fresh_slots, device=self.device))
            for key, slot in step.restores:
                assert self.snapshots is not None
                self.snapshots.restore(key, self.state_cache, slot)
        self.kv_cache.zero_new_blocks(step.block_tables)
        positions, meta = build_metadata(step.starts, step.num_new_tokens, step.block_tables, self.block_size,
                                         self.device, self.model.dtype)
        input_ids = torch.tensor(step.token_ids, device=self.device)
        ctx = StepContext(positions, meta, self.caches, step.num_new_tokens, slots, step.capture_points,
                          verifying=frozenset(step.verifying))
        if self.decode_graphs is not None and ctx.is_decode:
            hidden = self.decode_graphs(input_ids, ctx)
        else:
            hidden = self.model(input_ids, ctx)
        self._captured = list(ctx.captured.values())
        self._kept = ctx.kept
        if not step.last_rows:
            return None, hidden, ctx
        # Only the last token of a sequence (and scored prompt rows) needs logits: the lm_head is the largest matrix
        # in small models.
        every_row = len(step.last_rows) == len(hidden) and step.last_rows == list(range(len(hidden)))
        last = hidden if every_row else hidden[torch.tensor(step.last_rows, device=self.device)]
        logits = self.model.compute_logits(last)
        return (logits if self.tp is None or self.tp.rank == 0 else None), hidden, ctx

    def serve(self) -> None:
        """A rank other than 0: run rank 0's steps until it shuts down."""
        assert self.tp is not None
        while (step := self.tp.receive()) is not None:
            self.forward(step)
