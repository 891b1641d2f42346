"""Reasoning sections: a reply's ``<think>...</think>`` section split from its answer (the server's
``--reasoning-parser``, and ``SamplingParams.reasoning``: stop strings and grammars apply after the section).

- ``qwen3``: the reply reasons only if it opens with ``<think>`` (with ``enable_thinking`` off, Qwen3's template
  puts an empty section in the prompt and the reply is all answer);
- ``deepseek_r1``: the template opens the section in the prompt, so the reply reasons until ``</think>``.

A section never closed (the reply ran out of tokens while thinking) is all reasoning. The answer starts after
the closing tag and the blank lines that follow it. Text is fed as it streams: a tag split across pieces is held
back until the next piece settles it, so streamed pieces reassemble to the whole reply's split.
"""

from __future__ import annotations

REASONING_PARSERS = ("qwen3", "deepseek_r1")
OPENED_IN_PROMPT = "deepseek_r1"  # the format whose replies start inside the section
START, END = "<think>", "</think>"


def opens_in_prompt(parser: str) -> bool:
    """Whether the chat template opens the section, so that a reply starts inside it."""
    return parser == OPENED_IN_PROMPT


class ReasoningSplitter:
    """One choice's reply, fed piece by piece: each :meth:`feed` returns its (reasoning, answer) text."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose from {', '.join(REASONING_PARSERS)}")
        self._opens_in_prompt = opens_in_prompt(parser)
        self._state = "opening"  # then "reasoning", "after" (blank lines after the close) and "answer"
        self._held = ""
        self.has_section = self._opens_in_prompt  # the reply has a reasoning section (perhaps empty)
        self.closed = False

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self._held + text)

    def finish(self) -> tuple[str, str]:
        """What was held back, once the reply has ended."""
        held, self._held = self._held, ""
        if self._state == "opening":
            return (held, "") if self._opens_in_prompt else ("", held)
        if self._state == "reasoning":
            return held, ""
        return "", held if self._state == "answer" else ""

    def _split(self, buf: str) -> tuple[str, str]:
        reasoning = answer = ""
        self._held = ""
        while buf:
            if self._state == "opening":
                if buf.startswith(START):
                    buf, self._state, self.has_section = buf[len(START):], "reasoning", True
                elif START.startswith(buf):
                    self._held = buf
                    return reasoning, answer
                else:
                    self._state = "reasoning" if self._opens_in_prompt else "answer"
            elif self._state == "reasoning":
                end = buf.find(END)
                if end >= 0:
                    reasoning += buf[:end]
                    buf, self._state, self.closed = buf[end + len(END):], "after", True
                else:
                    keep = _partial_suffix(buf, END)
                    reasoning += buf[:len(buf) - keep]
                    self._held = buf[len(buf) - keep:]
                    return reasoning, answer
            elif self._state == "after":
                stripped = buf.lstrip("\n")
                if stripped:
                    buf, self._state = stripped, "answer"
                else:
                    return reasoning, answer
            else:
                answer += buf
                buf = ""
        return reasoning, answer


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that begins ``tag`` (a tag that may be completed next)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
