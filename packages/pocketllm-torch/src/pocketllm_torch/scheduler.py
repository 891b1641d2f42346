"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Every step is either a prefill step (prompt chunks of several sequences, up to the token budget) or a decode
step (one token for every running sequence whose prompt is done, and its drafts where it has any): a decode row
then runs the same kernels whatever else is running, so a seeded request's tokens do not depend on its batch.
While a sequence decodes, the two kinds take turns and a prefill step holds one chunk's tokens
(``prefill_chunk_size``) in all, so that arriving prompts delay a decoding stream by about a chunk a token, not
by their whole prefill. Sequences
join and leave the running set at every step. When the KV cache is full, the newest sequence is preempted: its
blocks (and state slot) are freed and it goes back to the front of the queue, to recompute its prompt and
generated tokens later. A model with state layers (Gated DeltaNet) takes a state slot for each running sequence:
at most max_num_seqs, one each.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pocketllm_torch.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from pocketllm_torch.block_manager import BlockManager
    from pocketllm_torch.state_cache import StateSlots
    from pocketllm_torch.state_snapshots import StateSnapshots


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # per sequence: how many of its pending tokens run this step


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_chunk_size: int, state_slots: StateSlots | None = None,
                 snapshots: StateSnapshots | None = None, verify_state_rows: int | None = None,
                 scored_rows: int | None = None) -> None:
        self.block_manager = block_manager
        self.state_slots = state_slots  # a model with state layers: a slot per running sequence
        self.snapshots = snapshots  # and with prefix caching, its states at cached block boundaries
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk_size = prefill_chunk_size
        # A model with state layers keeps its state after each verified draft row: at most this many per step.
        self.verify_state_rows = verify_state_rows
        # Scored prompt rows (prompt_logprobs) a step may hold: each is a vocabulary of logits. None: no bound.
        self.scored_rows = scored_rows
        self._score_budget = 0  # this step's, left
        self._prefilled_last = False  # whether the last step was a prefill step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last is the first to be preempted
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch | None:
        self._score_budget = self.max_num_batched_tokens if self.scored_rows is None else self.scored_rows
        decoding = any(s.num_pending_tokens == 1 for s in self.running)
        batch = ScheduledBatch([], [])
        if not (decoding and self._prefilled_last):
            budget = self.max_num_batched_tokens
            batch = self._schedule_prefill(min(self.prefill_chunk_size, budget) if decoding else budget)
        self._prefilled_last = bool(batch.seqs)
        if not batch.seqs:
            batch = self._schedule_running(prefill=False, budget=self.max_num_batched_tokens)
        return batch if batch.seqs else None

    def mark_computed(self, batch: ScheduledBatch) -> None:
        """After a step (``num_new_tokens`` counting, for a verification, only the rows it kept): the tokens
        whose KV is now valid, their full blocks filed, and blocks past the sequence (a rejected draft's) freed."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += n
            self.block_manager.cache_computed_blocks(seq)
            self.block_manager.trim(seq, seq.num_tokens)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self._release(seq)

    def _schedule_prefill(self, budget: int) -> ScheduledBatch:
        # Prompts already under way come first: they hold blocks that only their progress pays off.
        batch = self._schedule_running(prefill=True, budget=budget)
        budget -= sum(batch.num_new_tokens)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.block_manager.cached_prefix(seq) if seq.reuses_prefix else []
            if self.snapshots is not None:  # state layers resume only where their state was kept
                while prefix and prefix[-1] not in self.snapshots:
                    prefix.pop()
            num_cached = len(prefix) * self.block_manager.block_size
            n = self._chunk(seq, num_cached, min(seq.num_tokens - num_cached, self.prefill_chunk_size, budget,
                                                 seq.scoring_room(num_cached, self._score_budget)))
            if n == 0 or not self.block_manager.can_admit(seq, prefix, num_cached + n):
                break
            self._score_budget -= seq.scored_rows(num_cached, n)
            self.block_manager.admit(seq, prefix, num_cached + n)
            self.waiting.popleft()
            if self.state_slots is not None:
                seq.state_slot = self.state_slots.allocate()
                seq.resume_from = prefix[-1] if prefix else None
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _schedule_running(self, prefill: bool, budget: int) -> ScheduledBatch:
        """Running sequences still in their prompt (prefill) or past it (decode), as far as blocks and ``budget``
        tokens allow."""
        batch = ScheduledBatch([], [])
        state_rows = budget if self.verify_state_rows is None else self.verify_state_rows
        for seq in [s for s in self.running if (s.num_pending_tokens > 1) == prefill]:
            if budget == 0:
                break
            n = self._chunk(seq, seq.num_computed_tokens, min(seq.num_pending_tokens, self.prefill_chunk_size, budget,
                                                              seq.scoring_room(seq.num_computed_tokens,
                                                                               self._score_budget)))
            if n == 0:
                continue
            if seq.status is SequenceStatus.RUNNING and self._reserve(seq, n, batch.seqs):
                self._score_budget -= seq.scored_rows(seq.num_computed_tokens, n)
                if not prefill:
                    drafted = self._draft_room(seq, min(budget - n, state_rows))
                    state_rows -= drafted
                    n += drafted
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
        return batch

    def _draft_room(self, seq: Sequence, budget: int) -> int:
        """How many of a decoding sequence's drafts run with it: as many as the token budget and the free blocks
        allow, without preempting anyone (a draft is worth less than another sequence's progress). Its drafts
        are cut to those."""
        room = min(len(seq.draft), budget)
        while room and not self.block_manager.can_allocate(seq, seq.num_tokens + room):
            room -= 1
        self.block_manager.allocate(seq, seq.num_tokens + room)
        del seq.draft[room:]
        return room

    def _chunk(self, seq: Sequence, start: int, n: int) -> int:
        """With state snapshots, a prompt chunk that is not the last ends at a block boundary, and never past the
        prompt's last full-block boundary: snapshots are taken where a chunk ends (see state_snapshots.py)."""
        if self.snapshots is None:
            return n
        block_size = self.block_manager.block_size
        last_boundary = (seq.num_tokens - 1) // block_size * block_size
        if start < last_boundary < start + n:
            return last_boundary - start
        end = (start + n) // block_size * block_size
        return end - start if start + n < seq.num_tokens and end > start else n

    def _reserve(self, seq: Sequence, num_new_tokens: int, scheduled: list[Sequence]) -> bool:
        """Allocate blocks for seq's next tokens, preempting the newest unscheduled sequences to make room."""
        num_tokens = seq.num_computed_tokens + num_new_tokens
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = next(s for s in reversed(self.running) if s not in scheduled)
            self._preempt(victim)
            if victim is seq:
                return False
        self.block_manager.allocate(seq, num_tokens)
        return True

    def _release(self, seq: Sequence) -> None:
        """Free the blocks and the state slot of a sequence leaving the running set."""
        self.block_manager.free(seq)
        if seq.state_slot is not None and self.state_slots is not None:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.draft = []  # proposed again once it decodes
        if seq.spec is not None:
            seq.spec.restart()
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
