"""Drafting with the multi-token-prediction head (``speculative_method="mtp"``, models/qwen3_5_mtp.py), for the
model runner.

After each step, ``catch_up`` runs the head over every row the target kept, each paired with the token after it
(the next prompt token, or the one the step emitted there), so that the head's keys and values cover every
computed position and its output at a sequence's last one is where the sequence's next drafts start. It runs for
sequences that do not draft too (a grammar's), whose blocks other requests may reuse from the prefix cache. Before a
verification, ``draft`` fills the drafts the scheduler made room for: draft 0 from that output, draft j from the
head run again on its output j - 1 and draft j - 1, one position further on. Those runs write the head's keys and
values past the computed tokens, into blocks the verification holds; the next catch-up rewrites each such
position before anything reads it.

A draft is drawn as the target draws its token at that position (DraftRow): the head's logits processed alike and
the same seeded noise, an exponential race (sampler.py). The target keeps a draft when its own draw is that token
(speculative.accepts): the emitted tokens are the target's draws, so a request's seed gives the same tokens
whether it drafted or not, and where the head's distribution is close to the target's the two races agree often
(a Gumbel coupling: with shared noise they pick the same token with probability near 1 - their total variation
distance). Greedy requests draft the head's argmax.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pocketllm_torch.speculative import fill_drafts, span_context

if TYPE_CHECKING:
    from torch import Tensor

    from pocketllm_torch.attention import KVCache
    from pocketllm_torch.models.qwen3_5_mtp import Qwen3_5MTP
    from pocketllm_torch.sequence import Sequence


class MTPDrafter:
    def __init__(self, head: Qwen3_5MTP, kv_cache: KVCache, block_size: int) -> None:
        self.head = head
        self.kv_cache = kv_cache  # its last layer is the head's
        self.block_size = block_size

    @torch.inference_mode()
    def catch_up(self, kept: list[tuple[Sequence, int, Tensor]]) -> None:
        """Run the head over each ``(sequence, first position, the target's hidden states of the rows it kept
        there, before the final norm)`` of a step; the sequences' tokens already hold the tokens after them."""
        if not kept:
            return
        token_ids: list[int] = []
        for seq, start, rows in kept:
            token_ids += seq.token_ids[start + 1:start + 1 + len(rows)]
        hidden = self.head.target.norm(torch.cat([rows for _, _, rows in kept]))
        out = self._run(token_ids, hidden, [(seq, start, len(rows)) for seq, start, rows in kept])
        last = 0
        for seq, _, rows in kept:
            last += len(rows)
            if seq.spec is not None:  # it drafts
                seq.spec.hidden = out[last - 1]

    @torch.inference_mode()
    def draft(self, seqs: list[Sequence]) -> None:
        """Fill in the drafts of these decoding sequences (see speculative.fill_drafts)."""
        outputs: dict[Sequence, Tensor] = {}  # the head's last output of each

        def logits_of(j: int, active: list[Sequence]) -> Tensor:
            if j == 0:
                hidden = torch.stack([_drafts_from(seq) for seq in active])
            else:  # the head on its own output and draft j - 1, at the position after the last one it ran at
                hidden = self._run([seq.draft[j - 1] for seq in active], torch.stack([outputs[s] for s in active]),
                                   [(seq, seq.num_computed_tokens - 1 + j, 1) for seq in active])
            outputs.update(zip(active, hidden, strict=True))
            return self.head.compute_logits(hidden)

        fill_drafts(seqs, logits_of)

    def _run(self, token_ids: list[int], hidden: Tensor, spans: list[tuple[Sequence, int, int]]) -> Tensor:
        """The head over ``(sequence, first position, rows)`` spans, in the sequences' blocks."""
        ctx = span_context(spans, self.kv_cache, [self.kv_cache.layers[-1]], self.block_size, self.head.target.dtype)
        return self.head(torch.tensor(token_ids, device=hidden.device), hidden, ctx)


def _drafts_from(seq: Sequence) -> Tensor:
    """The head's output at a sequence's last computed position (Drafter.propose drafts only once there is one)."""
    assert seq.spec is not None and seq.spec.hidden is not None
    return seq.spec.hidden
