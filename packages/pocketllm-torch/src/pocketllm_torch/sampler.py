"""Next-token choice on the logits' device, vectorised over the batch, with vLLM's semantics.

Order: min_tokens masking, logit_bias, repetition/frequency/presence penalties, the structured-output grammar's
mask (its packed bits unpacked on the device), then greedy argmax, or
temperature, top-k, top-p, min-p and a draw. Each row draws with noise seeded from its request's seed and the
index of the token it draws (an exponential race: argmax(p / Exp(1)) picks token i with probability p_i), so a seed
gives the same tokens whatever else is in the batch, and whatever drafts speculative decoding verified before. With
the Triton kernels (GPUs) the race runs in one kernel whose noise comes from Philox keyed by the same draw seeds:
as reproducible, but another stream than torch's generator, so a seed draws other tokens there than on CPU.
Logprobs come from the raw logits, before any of this.

A row is a sequence, or a sequence with draft tokens assumed after it (a verification row: see speculative.py);
both answer what the processing reads, as ``SampleRow``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import Tensor

from pocketllm.backend import SampledLogprobs, TokenLogprob
from pocketllm.structured import bitmask_words, fill_bitmasks
from pocketllm_torch import platform, triton_ops

if TYPE_CHECKING:
    from collections.abc import Sequence as Seq

    from pocketllm.sampling_params import SamplingParams
    from pocketllm.structured import Constraint

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SamplingFailure:
    """Why one sequence could not be sampled; the rest of its batch was."""

    message: str


Outcome = tuple[int, SampledLogprobs | None] | SamplingFailure
"""A row's new token and its logprobs, or why it could not be sampled."""

_MASK64 = (1 << 64) - 1


class SampleRow(Protocol):
    """What choosing a row's token reads: its request, and the tokens before this one."""

    @property
    def params(self) -> SamplingParams: ...
    @property
    def seed(self) -> int | None: ...  # the request's (or one drawn for it); None for greedy requests
    @property
    def stop_token_ids(self) -> frozenset[int]: ...
    @property
    def constraint(self) -> Constraint | None: ...
    @property
    def num_output_tokens(self) -> int: ...  # output tokens before this row's: the index of the one it draws
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def output_token_ids(self) -> list[int]: ...


def draw_seed(seed: int, index: int) -> int:
    """The noise seed of output token ``index`` of a request seeded ``seed`` (splitmix64 of the pair): a draw
    depends on nothing but the two, so speculative steps and batches never shift a request's stream."""
    z = ((seed & _MASK64) + (index + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sample_each(logits: Tensor, seqs: Seq[SampleRow]) -> list[Outcome]:
    """``sample`` for the batch, or, if that fails, row by row, so that one sequence's failure is its own."""
    try:
        tokens, logprobs = sample(logits, seqs)
        return list(zip(tokens, logprobs, strict=True))
    except Exception:
        log.exception("sampling a batch of %d failed; sampling its rows one by one", len(seqs))
    results: list[Outcome] = []
    for row, seq in enumerate(seqs):
        try:
            [token], [lp] = sample(logits[row:row + 1], [seq])
            results.append((token, lp))
        except Exception as e:
            results.append(SamplingFailure(f"sampling failed: {type(e).__name__}: {e}"))
    return results


def sample(logits: Tensor, seqs: Seq[SampleRow]) -> tuple[list[int], list[SampledLogprobs | None]]:
    """Choose one token per row of ``logits`` [B, V] (float32) for ``seqs``; return them and their logprobs."""
    processed = process_logits(logits, seqs)
    token_ids = choose_tokens(processed, seqs)
    wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    logprobs: list[SampledLogprobs | None] = [None] * len(seqs)
    if wanted:
        ks = [seqs[i].params.logprobs or 0 for i in wanted]
        rows = torch.tensor(wanted, device=logits.device)
        for i, lp in zip(wanted, compute_logprobs(logits[rows], token_ids[rows], ks), strict=True):
            logprobs[i] = lp
    return token_ids.tolist(), logprobs


def process_logits(logits: Tensor, seqs: Seq[SampleRow]) -> Tensor:
    """Logits after min_tokens, logit_bias and penalties; ``logits`` itself is left untouched."""
    vocab_size, device = logits.shape[1], logits.device
    rows, cols = [], []
    for i, seq in enumerate(seqs):
        if seq.num_output_tokens < seq.params.min_tokens:
            banned = [t for t in seq.stop_token_ids if t < vocab_size]
            rows += [i] * len(banned)
            cols += banned
    if rows:
        logits = logits.index_put((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                                  torch.tensor(float("-inf"), device=device))
    rows, cols, values = [], [], []
    for i, seq in enumerate(seqs):
        rows += [i] * len(seq.params.logit_bias)
        cols += seq.params.logit_bias.keys()
        values += seq.params.logit_bias.values()
    if rows:
        logits = logits.index_put((torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
                                  torch.tensor(values, device=device), accumulate=True)
    params = [seq.params for seq in seqs]
    if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty for p in params):
        logits = apply_penalties(logits, [seq.prompt_token_ids for seq in seqs],
                                 [seq.output_token_ids for seq in seqs], [p.repetition_penalty for p in params],
                                 [p.frequency_penalty for p in params], [p.presence_penalty for p in params])
    if any(seq.constraint is not None for seq in seqs):
        logits = logits.masked_fill(~grammar_mask(seqs, vocab_size, device), float("-inf"))
    return logits


def grammar_mask(seqs: Seq[SampleRow], vocab_size: int, device: torch.device) -> Tensor:
    """[B, V] bool: the tokens each row's grammar allows next (every token for rows without one)."""
    packed = np.full((len(seqs), bitmask_words(vocab_size)), -1, dtype=np.int32)
    fill_bitmasks([(i, seq.constraint) for i, seq in enumerate(seqs) if seq.constraint is not None], packed)
    for row, seq in zip(packed, seqs, strict=True):
        if seq.constraint is not None and not _leaves_a_token(row, seq):  # argmax would pick token 0 regardless
            raise ValueError("no token may be sampled: the grammar (with min_tokens) allows none")
    words = torch.from_numpy(packed).to(device)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32, device=device)) & 1
    return bits.view(len(seqs), -1)[:, :vocab_size].bool()


def _leaves_a_token(words: np.ndarray, seq: SampleRow) -> bool:
    """Whether a grammar's mask row leaves a token once min_tokens bans the stop tokens."""
    if seq.num_output_tokens < seq.params.min_tokens:
        words = words.view(np.uint32).copy()
        for token in seq.stop_token_ids:
            if token // 32 < len(words):
                words[token // 32] &= ~np.uint32(1 << (token % 32))
    return bool(words.any())


def apply_penalties(logits: Tensor, prompt_ids: list[list[int]], output_ids: list[list[int]],
                    repetition: list[float], frequency: list[float], presence: list[float]) -> Tensor:
    """Repetition over prompt and output tokens (divide positive logits, multiply negative ones); frequency
    (times the count) and presence (once) over output tokens only."""
    device = logits.device
    output_counts = _token_counts(output_ids, logits.shape[1], device)
    seen = (_token_counts(prompt_ids, logits.shape[1], device) > 0) | (output_counts > 0)
    rep = torch.tensor(repetition, device=device)[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - torch.tensor(frequency, device=device)[:, None] * output_counts
    return logits - torch.tensor(presence, device=device)[:, None] * (output_counts > 0)


def _token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> Tensor:
    """[B, V] occurrences of each token per row; rows are padded with an extra bin that is cut off."""
    width = max(map(len, token_ids), default=0)
    padded = torch.tensor([ids + [vocab_size] * (width - len(ids)) for ids in token_ids], dtype=torch.long,
                          device=device).view(len(token_ids), width)
    counts = torch.zeros(len(token_ids), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]


def choose_tokens(logits: Tensor, seqs: Seq[SampleRow]) -> Tensor:
    greedy_ids = logits.argmax(dim=-1)
    params = [seq.params for seq in seqs]
    if all(p.is_greedy for p in params):
        return greedy_ids
    device = logits.device
    is_greedy = torch.tensor([p.is_greedy for p in params], device=device)
    temperature = torch.tensor([1.0 if p.is_greedy else p.temperature for p in params], device=device)
    logits = logits / temperature[:, None]
    if any(p.effective_top_k or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.effective_top_k or logits.shape[1] for p in params], device=device)
        logits = top_k_top_p(logits, top_k, torch.tensor([p.top_p for p in params], device=device))
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        probs = torch.where(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0, probs)
    if triton_ops.use_triton(probs):  # the race in one kernel, its noise keyed by the same draw seeds
        seeds = [draw_seed(seq.seed, seq.num_output_tokens) if seq.seed is not None else 0 for seq in seqs]
        signed = torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in seeds], device=device)
        return torch.where(is_greedy, greedy_ids, triton_ops.exponential_race(probs, signed))
    owner = platform.of(device)
    noise_device = owner.noise_device(device) if owner is not None else device
    noise = torch.ones(probs.shape, dtype=probs.dtype, device=noise_device)
    generator = torch.Generator(noise_device)
    for row, seq in zip(noise, seqs, strict=True):
        if seq.seed is not None:
            row.exponential_(generator=generator.manual_seed(draw_seed(seq.seed, seq.num_output_tokens)))
    return torch.where(is_greedy, greedy_ids, probs.div_(noise.to(device)).argmax(dim=-1))


def top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Keep each row's top_k logits, then the fewest of those whose probability reaches top_p; -inf the rest."""
    ordered, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=logits.device)
    ordered = ordered.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = ordered.softmax(dim=-1)
    # A token stays while the tokens ranked above it fall short of top_p; the first one always stays, also when
    # top_p underflows to 0 in float32. Rows without top-p keep their whole tail even where the float cumsum
    # reaches 1 early.
    above = probs.cumsum(dim=-1) - probs
    cut = (above >= top_p[:, None]) & (top_p[:, None] < 1.0) & (rank > 0)
    ordered = ordered.masked_fill(cut, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def compute_logprobs(logits: Tensor, token_ids: Tensor, ks: list[int]) -> list[SampledLogprobs]:
    """Logprob and 1-based rank of each row's token under log_softmax(logits), and the row's top k."""
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(max(ks), dim=-1)
    rows = zip(token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(),
               top_values.tolist(), ks, strict=True)
    results = []
    for token, logprob, rank, ids, values, k in rows:
        # topk orders equal values arbitrarily; argmax takes the lowest id, so ties go by id (bf16 logits tie often).
        top = sorted(zip(values, ids, strict=True), key=lambda pair: (-pair[0], pair[1]))[:k]
        results.append(SampledLogprobs(token, logprob, rank, [TokenLogprob(i, v) for v, i in top]))
    return results
