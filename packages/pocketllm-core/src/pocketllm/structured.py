"""Structured outputs: grammar-constrained decoding with llguidance.

A request asks for one of: a JSON schema, any JSON object, a regular expression, a choice among strings, or a
grammar (Lark, or llama.cpp's GBNF). The core compiles it once per distinct request (cached by its spec), off
the engine thread, into a :class:`Constraint` per engine request; a backend that declares
``Capabilities.structured_outputs`` gets that constraint in ``Engine.add_request`` and, before each token of
the request, masks the logits to :meth:`Constraint.fill_bitmask`'s tokens, then tells it the token it chose
(:meth:`Constraint.accept`). When the grammar is complete only end-of-sequence tokens remain allowed.

llguidance rather than xgrammar: both compute masks in tens of microseconds, but xgrammar's wheel requires
torch, transformers and triton, which the core must not import; llguidance has no dependencies.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from pocketllm.errors import ConfigError
from pocketllm.limits import MAX_GRAMMAR_CHARS

if TYPE_CHECKING:
    import llguidance

    from pocketllm.tokenizer import Tokenizer

_CACHE_SIZE = 256  # compiled grammars kept, least recently used first out


class StructuredOutputs(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """What the output must match; exactly one field is set (vLLM's ``structured_outputs``)."""

    json: dict[str, Any] | bool | str | None = None  # a JSON schema (a dict, or its JSON text)
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF (llama.cpp's grammars: lines with ::=)

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ConfigError("structured_outputs", f"set exactly one of json, json_object, regex, choice and "
                                                    f"grammar, got {', '.join(kinds) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ConfigError("structured_outputs", "choice must be a non-empty list of non-empty strings")
        try:
            size = len(self.key())
        except RecursionError:  # a schema nested thousands deep: refused here, not in a compiler's recursion
            raise ConfigError("structured_outputs", "is nested too deeply") from None
        if size > MAX_GRAMMAR_CHARS:
            raise ConfigError("structured_outputs", f"is longer than {MAX_GRAMMAR_CHARS} characters")

    def key(self) -> str:
        return msgspec.json.encode(self).decode()

    def grammar_text(self) -> str:
        """llguidance's grammar for this spec (its errors are the caller's to name)."""
        import llguidance

        if self.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choice))
        assert self.grammar is not None
        text = self.grammar
        if "::=" in text:  # GBNF
            from llguidance.gbnf_to_lark import gbnf_to_lark

            text = gbnf_to_lark(text)
        return llguidance.LLMatcher.grammar_from_lark(text)


class Constraint:
    """One engine request's grammar state: which tokens may come next, advanced by each token chosen."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into ``out``, int32 [(vocab_size + 31) // 32]: bit t % 32 of word t // 32."""
        import llguidance.numpy

        llguidance.numpy.fill_next_token_bitmask(self._matcher, out.reshape(1, -1), 0)

    def accept(self, token_id: int) -> None:
        """The token chosen under the mask (an end-of-sequence token once the grammar is complete)."""
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token_id)

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or None


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmasks(rows: list[tuple[int, Constraint]], out: np.ndarray) -> None:
    """``Constraint.fill_bitmask`` into ``out[i]`` (int32 [B, words]) for each (i, constraint) of a batch, in
    one call that spreads the rows over llguidance's threads with the GIL released."""
    import llguidance.numpy

    llguidance.numpy.fill_next_token_bitmask_par(_executor(), [(c._matcher, i) for i, c in rows], out)


@functools.cache
def _executor() -> llguidance.LLExecutor:
    import llguidance

    return llguidance.LLExecutor()


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer, caching the compiled grammars by spec."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @functools.cached_property
    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        eos = list(self._tokenizer.eos_token_ids) or None
        return llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)

    def constraint(self, spec: StructuredOutputs) -> Constraint:
        """A fresh constraint for one engine request; ConfigError naming structured_outputs for a bad spec."""
        import llguidance

        key = spec.key()
        with self._lock:
            pristine = self._cache.get(key)
            if pristine is not None:
                self._cache.move_to_end(key)
        if pristine is None:
            try:
                grammar = spec.grammar_text()
            except Exception as e:  # llguidance's parsers raise ValueError, RuntimeError and their own types
                raise ConfigError("structured_outputs", f"invalid {_kind(spec)}: {e}") from None
            with self._lock:
                tokenizer = self._ll_tokenizer
            pristine = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if pristine.is_error():
                raise ConfigError("structured_outputs", f"invalid {_kind(spec)}: {pristine.get_error()}")
            with self._lock:
                self._cache[key] = pristine
                while len(self._cache) > _CACHE_SIZE:
                    self._cache.popitem(last=False)
        return Constraint(pristine.deep_copy(), self.vocab_size)


def _kind(spec: StructuredOutputs) -> str:
    if spec.json is not None:
        return "JSON schema"
    return "json_object" if spec.json_object else "regex" if spec.regex else "choice" if spec.choice else "grammar"
