"""Prompt token ids, built once with PocketLLM's tokenizer and chat template and sent to every engine."""

from __future__ import annotations

from dataclasses import dataclass

from pocketllm.chat import ChatPromptBuilder
from pocketllm.checkpoint import Checkpoint
from pocketllm.tokenizer import Tokenizer

# Plain prose: the content does not matter for speed (EOS is ignored), only the token count does.
TEXT = (
    "The harbour town woke slowly. Fishermen untangled their nets while gulls argued over the scraps, and the baker "
    "on Quay Street pulled the first loaves from an oven older than anyone could remember. Down by the lighthouse, a "
    "girl named Ada counted the ships on the horizon and wrote their names in a notebook with a green cover. Her "
    "grandfather had taught her the flags of every nation, the shapes of hulls and the way a sail leans when the "
    "wind turns east. By noon the market filled with voices: merchants calling prices, children chasing a loose "
    "goat, an old sailor telling the same story about the storm of the century to anyone who would stop and listen. "
)

# Questions whose greedy answers have clear margins: on the default model, the top two float32 logits stay at least
# 0.49 apart over the first 32 tokens (transformers). Near-ties would let correct engines disagree (see the report).
FIDELITY_QUESTIONS = (
    "What are the first ten prime numbers?",
    "Count from 1 to 20, separated by commas.",
    "What are the first ten square numbers?",
)


@dataclass(frozen=True)
class PromptSet:
    prefill: list[int]
    prompts: list[list[int]]  # one per concurrent sequence, each prompt_tokens long
    fidelity: list[tuple[str, list[int]]]  # (question, chat-rendered ids)


def build_prompts(checkpoint: Checkpoint, *, prefill_tokens: int, prompt_tokens: int, count: int,
                  fidelity_prompts: int) -> PromptSet:
    tokenizer = Tokenizer.from_checkpoint(checkpoint)
    stream = tokenizer.encode(TEXT, add_special_tokens=False)
    needed = max(prefill_tokens, prompt_tokens + 7 * count)
    stream = stream * (needed // len(stream) + 1)
    # Each sequence starts at a different offset so that no two prompts are identical.
    prompts = [stream[7 * i:7 * i + prompt_tokens] for i in range(count)]
    builder = ChatPromptBuilder(tokenizer)
    fidelity = []
    for question in FIDELITY_QUESTIONS[:fidelity_prompts]:
        text = builder.render([{"role": "user", "content": question}], add_generation_prompt=True)
        fidelity.append((question, tokenizer.encode(text, add_special_tokens=False)))
    return PromptSet(prefill=stream[:prefill_tokens], prompts=prompts, fidelity=fidelity)
