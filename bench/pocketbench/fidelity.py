"""Greedy token ids of every engine on the same chat prompts, and where PocketLLM's first differ."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FidelityCase:
    question: str
    prompt_ids: list[int]
    outputs: dict[str, list[int]]  # engine label -> greedy ids


@dataclass(frozen=True)
class Difference:
    ours: str
    peer: str
    index: int | None  # first position where the ids differ; None when they are identical


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def differences(case: FidelityCase, ours: list[str], peers: list[str]) -> list[Difference]:
    return [Difference(o, p, first_difference(case.outputs[o], case.outputs[p])) for o in ours for p in peers]
