"""The draw of a sampled token on the device: each row's exponential race, argmax(p / Exp(1)), which picks token i
with probability p_i, its noise from Triton's Philox generator keyed by the row's draw seed (``sampler.draw_seed``
of the request's seed and the token's index), so that a row's draw depends on nothing but its probabilities and
that seed: the same token alone or in any batch. One program per row; the other sampling steps (temperature,
top-k/p, min-p) are the torch sampler's, on the device already."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024  # vocabulary entries per iteration


@triton.jit
def _race(probs_ptr, seeds_ptr, out_ptr, vocab, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + row)
    best = tl.full([], -1.0, tl.float32)
    best_index = tl.full([], 0, tl.int64)
    for start in range(0, vocab, BLOCK_V):
        i = start + tl.arange(0, BLOCK_V)
        mask = i < vocab
        p = tl.load(probs_ptr + row * vocab + i, mask=mask, other=0.0).to(tl.float32)
        noise = -tl.log(1.0 - tl.rand(seed, i))  # Exp(1); 1 - u is in (0, 1]
        score = tl.where(mask, p / noise, -1.0)
        block_best = tl.max(score, axis=0)
        block_index = start + tl.argmax(score, axis=0).to(tl.int64)
        better = block_best > best  # ties keep the lower index, as torch's argmax does
        best_index = tl.where(better, block_index, best_index)
        best = tl.where(better, block_best, best)
    tl.store(out_ptr + row, best_index)


def exponential_race(probs: Tensor, seeds: Tensor) -> Tensor:
    """Token index drawn from each row of probs [B, V] (rows need not be normalised; zeros are never drawn unless a
    row is all zeros) with seeds [B] (int64, all 64 bits keying Philox)."""
    rows, vocab = probs.shape
    out = torch.empty(rows, dtype=torch.int64, device=probs.device)
    _race[(rows,)](probs.contiguous(), seeds.contiguous(), out, vocab,
                   BLOCK_V=min(BLOCK, triton.next_power_of_2(vocab)))
    return out
