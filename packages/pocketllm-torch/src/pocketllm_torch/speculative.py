"""Speculative decoding in the torch engine: who drafts before a step, and what a verification step keeps.

A decode step runs a drafting sequence's last token and its k drafts as one query of k + 1 rows. Row j is sampled
as if drafts 0..j-1 were already the sequence's (its penalties, min_tokens and draw index see them: ``DraftRow``),
so row j's token is the one the sequence would sample there without speculation, from the same seeded noise.
Draft j is accepted while it equals row j's token. For drafts that are single tokens (ngram) this is exactly
rejection sampling (Leviathan et al.): a draft d is kept with probability p(d), and a rejected position's token is a
draw from p without d, its residual. The step emits rows 0..a (a: drafts accepted), so greedy and seeded outputs are
the tokens of decoding without speculation. The rejected rows' keys and values are overwritten before anything
reads them (whole blocks past the sequence are freed), and state layers keep their state after every row so that
the accepted one is committed (model_runner.py).

Drafts come from the sequence itself (``ngram``: NgramProposer, before the step is scheduled), from the model's
multi-token-prediction head (``mtp``) or from a smaller model (``draft_model``): for those the scheduler holds
room for k drafts, which mtp.py or draft_model.py fills in before the forward.

Grammar-constrained requests do not draft: their mask depends on the grammar's state after each drafted token,
which would have to be advanced and rolled back per draft; they decode one token per step alongside the others.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pocketllm.ngram_proposer import NgramProposer
from pocketllm_torch.attention import build_metadata
from pocketllm_torch.context import StepContext
from pocketllm_torch.sampler import choose_tokens, process_logits

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from torch import Tensor

    from pocketllm.args import EngineArgs
    from pocketllm.backend import BackendStats
    from pocketllm.sampling_params import SamplingParams
    from pocketllm.structured import Constraint
    from pocketllm_torch.attention import KVCache
    from pocketllm_torch.sequence import Sequence

# After this many drafts in a row with nothing accepted, a sequence pauses drafting for 2, 4, ... steps (at most
# MAX_PAUSE): on text that never repeats itself, a verification row that is always rejected costs its share of a
# step, and the pauses bound that share.
MAX_PAUSE = 64
# A draft the MTP head has yet to fill in (see the module docstring): it holds the draft's room in the schedule.
PENDING = -1


def accepts(sampled: int, drafted: int) -> bool:
    """Whether a verification row keeps its draft: the row's own draw (from the target's distribution after
    every logits processor) is the drafted token. For a single-token proposal that is Leviathan et al.'s rule."""
    return sampled == drafted


@dataclass(frozen=True, slots=True)
class DraftRow:
    """Row ``drafted`` of a verification: the sequence with its first ``drafted`` drafts taken as its own (a
    ``sampler.SampleRow``)."""

    seq: Sequence
    drafted: int

    @property
    def params(self) -> SamplingParams:
        return self.seq.params

    @property
    def seed(self) -> int | None:
        return self.seq.seed

    @property
    def stop_token_ids(self) -> frozenset[int]:
        return self.seq.stop_token_ids

    @property
    def constraint(self) -> Constraint | None:
        return self.seq.constraint

    @property
    def num_output_tokens(self) -> int:
        return self.seq.num_output_tokens + self.drafted

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seq.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.seq.output_token_ids + self.seq.draft[:self.drafted]


@dataclass(slots=True)
class DraftState:
    """A drafting sequence's proposer and how much it drafts: k shrinks to what was last accepted (plus one) and
    doubles while whole drafts are accepted; drafts that keep missing pause it."""

    proposer: NgramProposer | None  # None: a model drafts (the MTP head, or a draft model)
    k: int
    pause: int = 0  # steps left without drafting
    misses: int = 0  # drafts in a row with nothing accepted
    hidden: Tensor | None = None  # MTP: the head's output at the last computed position, where drafts start
    # draft_model: positions whose keys and values the draft model holds (its later ones are rejected drafts')
    seen: int = 0

    def restart(self) -> None:
        """After preemption: the caches are gone, with what drafting kept of them."""
        self.hidden, self.seen = None, 0


class Drafter:
    """The engine's drafting policy and its counters (``BackendStats``'s ``num_spec_*``)."""

    def __init__(self, args: EngineArgs, max_batch: int) -> None:
        self.method = args.speculative_method
        self.ngram: tuple[int, int] | None = None
        if args.speculative_method == "ngram":
            assert args.ngram_min is not None and args.ngram_max is not None
            self.ngram = args.ngram_min, args.ngram_max
        self.max_k = args.num_speculative_tokens
        self.max_batch = max_batch  # more running sequences than this, and nobody drafts
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_position = [0] * self.max_k

    def count_into(self, stats: BackendStats) -> None:
        stats.num_spec_drafts = self.num_drafts
        stats.num_spec_draft_tokens = self.num_draft_tokens
        stats.num_spec_accepted_tokens = self.num_accepted_tokens
        stats.spec_accepted_per_position = list(self.accepted_per_position)

    def start(self, seq: Sequence) -> None:
        """Give a new sequence its drafter, unless it is grammar-constrained (see the module docstring)."""
        if seq.constraint is None and seq.pooling is None:
            seq.spec = DraftState(NgramProposer(*self.ngram) if self.ngram else None, self.max_k)

    def propose(self, running: list[Sequence]) -> None:
        """Before a step: the drafts of the running sequences that decode next."""
        drafting = len(running) <= self.max_batch
        for seq in running:
            if seq.spec is not None and seq.num_pending_tokens == 1 and not seq.draft:
                seq.draft = self._draft(seq, seq.spec) if drafting else []

    def _draft(self, seq: Sequence, state: DraftState) -> list[int]:
        if state.pause:
            state.pause -= 1
            return []
        room = min(state.k, seq.max_output_tokens - seq.num_output_tokens - 1)  # the token after them must fit
        if state.proposer is not None:
            return state.proposer.propose(seq.token_ids, room)
        if self.method == "mtp" and state.hidden is None:  # the head has not run over the sequence yet
            return []
        return [PENDING] * room

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A verification of ``drafted`` tokens accepted its first ``accepted``."""
        state = seq.spec
        if state is None or not drafted:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for position in range(accepted):
            self.accepted_per_position[position] += 1
        state.seen += min(accepted, drafted - 1)  # draft_model: the accepted drafts it ran (all but the last)
        if accepted == drafted:
            state.k = min(self.max_k, 2 * state.k)
        else:
            state.k = accepted + 1
        state.misses = 0 if accepted else state.misses + 1
        if state.misses >= 2:
            state.pause = min(MAX_PAUSE, 1 << (state.misses - 1))


def fill_drafts(seqs: list[Sequence], logits_of: Callable[[int, list[Sequence]], Tensor]) -> None:
    """The drafts of these decoding sequences that a model draws (``len(seq.draft)`` of them each, held by
    Drafter.propose and cut to what the step has room for): draft j of each sequence still drafting from the
    drafting model's logits ``logits_of(j, those sequences)``, drawn as verification row j will draw (DraftRow)."""
    active = [seq for seq in seqs if seq.draft]
    for j in range(max((len(seq.draft) for seq in active), default=0)):
        rows = [DraftRow(seq, j) for seq in active]
        tokens = choose_tokens(process_logits(logits_of(j, active), rows), rows).tolist()
        for seq, token in zip(active, tokens, strict=True):
            seq.draft[j] = token
        active = [seq for seq in active if len(seq.draft) > j + 1]


def span_context(spans: list[tuple[Sequence, int, int]], kv_cache: KVCache, layers: list[Tensor], block_size: int,
                 dtype: torch.dtype) -> StepContext:
    """A drafting model's pass over ``(sequence, first position, tokens)`` spans, its keys and values in
    ``layers`` of ``kv_cache`` through the sequences' own block tables (blocks used for the first time zeroed)."""
    tables = [seq.block_table for seq, _, _ in spans]
    kv_cache.zero_new_blocks(tables)
    lengths = [n for _, _, n in spans]
    positions, meta = build_metadata([start for _, start, _ in spans], lengths, tables, block_size,
                                     kv_cache.blocks.device, dtype)
    return StepContext(positions, meta, layers, lengths, None)
