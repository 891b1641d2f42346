"""A request as the scheduler and model runner see it: its tokens, its progress and its KV blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pocketllm.backend import SampledLogprobs
    from pocketllm.pooling import PoolingParams
    from pocketllm.sampling_params import SamplingParams
    from pocketllm.structured import Constraint
    from pocketllm_torch.speculative import DraftState


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    FINISHED = enum.auto()


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    max_output_tokens: int  # max_tokens, further bounded by max_model_len
    stop_token_ids: frozenset[int]  # EOS unless ignore_eos, and params.stop_token_ids
    seed: int | None  # its draws' seed (see sampler.draw_seed): its own or one drawn for it; None if greedy
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose keys and values are in the cache. Reset to 0 by preemption: they are recomputed.
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # prefix hash of each computed full block
    state_slot: int | None = None  # its slot in the state layers' caches while running (hybrid models)
    resume_from: int | None = None  # prefix hash of the state snapshot to load into that slot before it runs
    constraint: Constraint | None = None  # structured outputs: the grammar each next token must follow
    pooling: PoolingParams | None = None  # an embedding request: its prompt's states are pooled, nothing sampled
    pooled: torch.Tensor | None = None  # the pooling so far, over the prompt chunks that ran (float32)
    # Speculative decoding: the tokens drafted after its last one, which its next step verifies, and its drafter
    # (None: it does not draft).
    draft: list[int] = field(default_factory=list)
    spec: DraftState | None = None
    # params.prompt_logprobs: those of prompt tokens 1, 2, ... scored so far (a preempted prompt is not rescored).
    prompt_logprobs: list[SampledLogprobs] = field(default_factory=list)

    @property
    def reuses_prefix(self) -> bool:
        """Whether cached blocks may stand in for its first tokens: not when their hidden states are pooled, nor
        when its prompt is scored (cached blocks have no logits)."""
        if self.params.prompt_logprobs is not None:
            return False
        return self.pooling is None or self.pooling.pooling_type == "last"

    def scored_rows(self, start: int, count: int) -> int:
        """Of ``count`` tokens from ``start``, how many score a prompt token not scored yet (the rows of the
        positions before prompt tokens 1 .. P-1; none unless its prompt is scored)."""
        if self.params.prompt_logprobs is None:
            return 0
        return max(0, min(start + count, self.num_prompt_tokens - 1) - max(start, len(self.prompt_logprobs)))

    def scoring_room(self, start: int, budget: int) -> int:
        """The most tokens from ``start`` it may run with ``budget`` scored rows left in a step."""
        first = max(start, len(self.prompt_logprobs))
        if self.params.prompt_logprobs is None or first >= self.num_prompt_tokens - 1:
            return self.num_tokens
        return first - start + max(budget, 0)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run through the model; the last of them yields the next token."""
        return len(self.token_ids) - self.num_computed_tokens

    def step_token_ids(self, start: int, n: int) -> list[int]:
        """The ``n`` tokens a step runs from ``start``: its own, then its drafts."""
        ids = self.token_ids[start:start + n]
        return ids if len(ids) == n else ids + self.draft[:n - len(ids)]

    def finish_reason(self) -> str | None:
        """Why the sequence is done after its latest token, if it is."""
        if self.num_output_tokens > 0 and self.token_ids[-1] in self.stop_token_ids:
            return "stop"
        if self.num_output_tokens >= self.max_output_tokens:
            return "length"
        return None
