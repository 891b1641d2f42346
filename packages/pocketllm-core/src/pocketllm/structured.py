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

import asyncio
import contextlib
import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import wait
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from pocketllm import grammar_bounds
from pocketllm import reasoning as reasoning_tags
from pocketllm.errors import ConfigError, OverloadedError, PocketLLMError
from pocketllm.grammar_pool import CompilePool, Job
from pocketllm.limits import (
    GRAMMAR_COMPILE_STACK_BYTES,
    GRAMMAR_COMPILE_THREADS,
    GRAMMAR_COMPILE_TIMEOUT_S,
    MAX_GRAMMAR_ALTERNATIVES,
    MAX_GRAMMAR_CHARS,
    MAX_QUEUED_GRAMMAR_COMPILES,
)
from pocketllm.reasoning import ReasoningSplitter

if TYPE_CHECKING:
    import llguidance

    from pocketllm.tokenizer import Tokenizer

MAX_ERROR_CHARS = 200  # of llguidance's message in an error: its first line, which says what is wrong
# JSON without whitespace between tokens (a schema's "x-guidance" may ask otherwise): where any whitespace is
# allowed, a small model sampled warm can spend its whole budget on newlines inside an array.
JSON_OPTIONS = {"whitespace_flexible": False}


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
        if self.choice is not None and len(self.choice) > MAX_GRAMMAR_ALTERNATIVES:
            raise ConfigError("structured_outputs", f"choice has {len(self.choice)} options, more than "
                                                    f"{MAX_GRAMMAR_ALTERNATIVES} (the limit)")
        try:
            size = len(self.key())
        except RecursionError:  # a schema nested thousands deep: refused here, not in a compiler's recursion
            raise ConfigError("structured_outputs", "is nested too deeply") from None
        if size > MAX_GRAMMAR_CHARS:
            raise ConfigError("structured_outputs", f"is longer than {MAX_GRAMMAR_CHARS} characters")

    def key(self) -> str:
        return msgspec.json.encode(self).decode()

    def grammar_text(self, special_tokens: Sequence[str] = ()) -> str:
        """llguidance's grammar for this spec, once it is within the bounds of :mod:`pocketllm.grammar_bounds` and
        needs none of ``special_tokens``' texts (a ConfigError otherwise; llguidance's own errors are the caller's
        to name)."""
        import llguidance

        if self.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.json is not None:
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            grammar_bounds.check_schema(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if self.regex is not None:
            grammar_bounds.check_regex(self.regex)
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            grammar_bounds.check_choice(self.choice, special_tokens)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.choice))
        assert self.grammar is not None
        text = self.grammar
        if "::=" in text:  # GBNF
            from llguidance.gbnf_to_lark import gbnf_to_lark

            text = gbnf_to_lark(grammar_bounds.gbnf_in_dependency_order(text))
        grammar_bounds.check_lark(text, special_tokens)
        return llguidance.LLMatcher.grammar_from_lark(text)


class ReasoningGate:
    """Keeps a reply's reasoning section (see :mod:`pocketllm.reasoning`) out of its grammar's reach: the grammar
    sees the tokens after the closing tag. In the qwen3 format the section is optional: the first token may open
    it (its single token is allowed beside the grammar's), and any other first token starts the answer. The close
    is found by the same splitter the output processor uses, fed each token's text, however the model spelled
    the tag in tokens."""

    def __init__(self, opens_in_prompt: bool, start_id: int | None, decode: Callable[[list[int]], str]) -> None:
        self._start_id, self._decode = start_id, decode
        self._section = ReasoningSplitter(reasoning_tags.OPENED_IN_PROMPT)  # the section's text, to its close
        self.state = "reasoning" if opens_in_prompt else "opening" if start_id is not None else "answer"

    @property
    def masks(self) -> bool:
        """Whether the grammar's mask applies to the next token."""
        return self.state != "reasoning"

    @property
    def also_allowed(self) -> int | None:
        """A token allowed beside the grammar's: the section's opening tag, while it may still come."""
        return self._start_id if self.state == "opening" else None

    def take(self, token_id: int) -> bool:
        """Follow one chosen token; True when it belongs to the section (the grammar must not see it)."""
        if self.state == "opening":
            self.state = "reasoning" if token_id == self._start_id else "answer"
            return self.state == "reasoning"
        if self.state == "reasoning":
            self._section.feed(self._decode([token_id]))
            if self._section.closed:
                self.state = "answer"
            return True
        return False


class Constraint:
    """One engine request's grammar state: which tokens may come next, advanced by each token chosen."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, gate: ReasoningGate | None = None, *,
                 stop_ids: frozenset[int] = frozenset()) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._gate = gate
        self._stop_ids = stop_ids  # what may follow a complete grammar: the end-of-sequence tokens
        self._violation: str | None = None

    def fill_bitmask(self, out: np.ndarray) -> None:
        """Write the allowed next tokens into ``out``, int32 [(vocab_size + 31) // 32]: bit t % 32 of word t // 32."""
        fill_bitmasks([(0, self)], out.reshape(1, -1))

    def accept(self, token_id: int) -> None:
        """The token chosen under the mask (an end-of-sequence token once the grammar is complete)."""
        if self._gate is not None and self._gate.take(token_id):
            return
        if not self._matcher.is_stopped():
            self._matcher.consume_token(token_id)
        elif token_id not in self._stop_ids and self._violation is None:
            # The mask allowed only end-of-sequence, and something else (min_tokens, logit_bias) banned it.
            self._violation = f"token {token_id} came after the grammar was complete"

    @property
    def error(self) -> str | None:
        return self._matcher.get_error() or self._violation

    @property
    def complete(self) -> bool:
        """Whether the grammar has matched all it can: only end-of-sequence may come next."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def masks_next(self) -> bool:
        """Whether the next token is constrained at all (not inside a reasoning section)."""
        return self._gate is None or self._gate.masks


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def fill_bitmasks(rows: list[tuple[int, Constraint]], out: np.ndarray) -> None:
    """``Constraint.fill_bitmask`` into ``out[i]`` (int32 [B, words]) for each (i, constraint) of a batch, in
    one call that spreads the rows over llguidance's threads with the GIL released."""
    import llguidance.numpy

    masked = [(i, c) for i, c in rows if c.masks_next]
    for i, c in rows:
        if not c.masks_next:  # inside a reasoning section: every token may come
            out[i] = -1
    if masked:  # (the parallel fill splits even one row's vocabulary: 2x faster than the serial one here)
        llguidance.numpy.fill_next_token_bitmask_par(_executor(), [(c._matcher, i) for i, c in masked], out)
    for i, c in masked:
        extra = c._gate.also_allowed if c._gate is not None else None
        if extra is not None:
            out[i].view(np.uint32)[extra // 32] |= np.uint32(1 << (extra % 32))


@functools.cache
def _executor() -> llguidance.LLExecutor:
    import llguidance

    return llguidance.LLExecutor()


# What a compiled matcher holds, per character of its spec (StructuredOutputs.key()), from the growth of RSS
# with 4 to 40 matchers kept, each after its first mask, at 0.3-450 KB of spec; the same with a 323- and a
# 49,152-token vocabulary. Measured: a literal regex 450-490 bytes per character (each character a lexer
# state: the worst case of every kind, a long string literal anywhere costs as much), a regex of alternatives
# 75-120, choice 115-180, JSON schemas 90-150 (enums 35-55), Lark and GBNF rules 7-75; and 20-40 KB a matcher.
# The estimate takes each kind's worst case but literals': a spec that is one long literal (a JSON const, a Lark
# string) holds up to twice its estimate.
_BYTES_PER_CHAR = {"regex": 500, "choice": 200, "JSON schema": 250, "grammar": 250, "json_object": 0}
_BYTES_PER_MATCHER = 32 << 10


def estimated_bytes(spec: StructuredOutputs) -> int:
    """The memory a compiled ``spec`` is taken to hold in the cache (see _BYTES_PER_CHAR for the measurements)."""
    return _BYTES_PER_MATCHER + _BYTES_PER_CHAR[_kind(spec)] * len(spec.key())


class CompiledGrammar(msgspec.Struct, frozen=True):
    """A spec compiled once: the pristine matcher each request's Constraint copies, and its estimated size."""

    matcher: Any  # llguidance.LLMatcher
    nbytes: int


class GrammarCacheStats(msgspec.Struct, kw_only=True):
    num_entries: int
    num_bytes: int  # estimated (see estimated_bytes)
    capacity_bytes: int


class GrammarCompiler:
    """Compiles structured-output specs for one tokenizer, keeping compiled grammars by spec, least recently used
    first out, within ``cache_bytes`` of their estimated size. A failed compile is not kept."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_bytes: int = 64 << 20) -> None:
        self._tokenizer, self.vocab_size = tokenizer, vocab_size
        self._lock, self._tokenizer_lock = threading.Lock(), threading.Lock()
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_bytes, self._capacity = 0, cache_bytes
        # Compiles recurse as deep as a grammar's chains: only on threads whose stack the bounds were sized for,
        # which nothing else uses (see pocketllm.grammar_pool).
        self._pool = CompilePool(GRAMMAR_COMPILE_THREADS, MAX_QUEUED_GRAMMAR_COMPILES, GRAMMAR_COMPILE_STACK_BYTES)
        self.timeout_s = GRAMMAR_COMPILE_TIMEOUT_S

    @functools.cached_property
    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance

        eos = list(self._tokenizer.eos_token_ids) or None
        return llguidance.LLTokenizer(self._tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)

    def compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """``spec`` compiled (from the cache, else on a compile thread, waited for up to ``timeout_s``): a
        ConfigError naming structured_outputs for a bad spec or one too slow to compile, OverloadedError while the
        compile threads are all taken and ``timeout_s`` passes, or too many compiles wait for them."""
        cached = self._cached(spec.key())
        if cached is not None:
            return cached
        job = self._submit(spec)
        try:
            while not job.future.done():
                remaining = job.remaining(self.timeout_s)
                if remaining <= 0:
                    raise self._late(job)
                wait([job.future], timeout=remaining)
            return self._result(job)
        finally:
            self._pool.release(job)

    async def compile_async(self, spec: StructuredOutputs) -> CompiledGrammar:
        """:meth:`compile`, awaited: no thread waits (neither the event loop nor asyncio's default threads, which
        others need for chat templates and tokenizing); a cancelled caller stops waiting at once."""
        cached = self._cached(spec.key())
        if cached is not None:
            return cached
        job = self._submit(spec)
        try:
            loop, done = asyncio.get_running_loop(), asyncio.Event()

            def wake(_: object) -> None:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: no one to wake
                    loop.call_soon_threadsafe(done.set)

            job.future.add_done_callback(wake)
            while not job.future.done():
                remaining = job.remaining(self.timeout_s)
                if remaining <= 0:
                    raise self._late(job)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), remaining)
            return self._result(job)
        finally:
            self._pool.release(job)

    def constraint(self, spec: StructuredOutputs | CompiledGrammar, reasoning: str | None = None) -> Constraint:
        """A fresh constraint for one engine request, from ``spec`` compiled (see :meth:`compile`). With
        ``reasoning`` (a :data:`pocketllm.reasoning.REASONING_PARSERS` format) the grammar starts after the
        reply's reasoning section."""
        compiled = spec if isinstance(spec, CompiledGrammar) else self.compile(spec)
        return Constraint(compiled.matcher.deep_copy(), self.vocab_size,
                          self._gate(reasoning) if reasoning else None, stop_ids=self._stop_ids)

    def _cached(self, key: str) -> CompiledGrammar | None:
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
            return compiled

    def _submit(self, spec: StructuredOutputs) -> Job:
        return self._pool.submit(spec.key(), lambda: self._compile(spec))

    def _result(self, job: Job) -> CompiledGrammar:
        """A finished job's grammar, kept in the cache, or its error raised (to each of its waiters)."""
        error = job.future.exception()
        if error is not None:
            raise error.with_traceback(None)
        compiled: CompiledGrammar = job.future.result()
        self._keep(job.key, compiled)
        return compiled

    def _late(self, job: Job) -> PocketLLMError:
        if job.started_at is None:
            return OverloadedError(f"the grammar waited {self.timeout_s:g} s for a compile thread, all taken by "
                                   "other compiles: retry later")
        return ConfigError("structured_outputs", f"took more than {self.timeout_s:g} s to compile (the limit)")

    def cache_stats(self) -> GrammarCacheStats:
        with self._lock:
            return GrammarCacheStats(num_entries=len(self._cache), num_bytes=self._cache_bytes,
                                     capacity_bytes=self._capacity)

    def _keep(self, key: str, compiled: CompiledGrammar) -> None:
        """Cache ``compiled``, dropping the least recently used until it fits; one larger than the whole cache is
        not kept (it would only empty it)."""
        with self._lock:
            if key in self._cache or compiled.nbytes > self._capacity:
                return
            while self._cache_bytes + compiled.nbytes > self._capacity:
                self._cache_bytes -= self._cache.popitem(last=False)[1].nbytes
            self._cache[key] = compiled
            self._cache_bytes += compiled.nbytes

    def close(self) -> None:
        """Let the compile threads end."""
        self._pool.shutdown()

    def _compile(self, spec: StructuredOutputs) -> CompiledGrammar:
        """On a compile thread: the spec's pristine matcher, or a ConfigError naming structured_outputs."""
        import llguidance

        try:
            grammar = spec.grammar_text(self._special_texts)
        except ConfigError:
            raise
        except Exception as e:  # llguidance's parsers raise ValueError, RuntimeError and their own types
            raise ConfigError("structured_outputs", f"invalid {_kind(spec)}: {short_error(str(e))}") from None
        with self._tokenizer_lock:  # the first compile builds it (~0.5 s): not under the cache's lock
            tokenizer = self._ll_tokenizer
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=_limits())
        if matcher.is_error():
            raise ConfigError("structured_outputs", f"invalid {_kind(spec)}: {short_error(matcher.get_error())}")
        self._check_first_token(spec, matcher)
        return CompiledGrammar(matcher, estimated_bytes(spec))

    def _check_first_token(self, spec: StructuredOutputs, matcher: llguidance.LLMatcher) -> None:
        """Refuse a grammar that leaves no first token the model can write: an empty language (a regex that never
        matches, rules that never end, a $ref cycle through allOf), or text only a special token spells.
        Otherwise the request would fail in the engine, after it started. (The mask is computed again, from the
        same state, for each request.)"""
        words = np.frombuffer(matcher.compute_bitmask(), np.uint8)
        allowed = np.flatnonzero(np.unpackbits(words, bitorder="little")[:self.vocab_size])
        if matcher.is_error():
            error = short_error(matcher.get_error())
            raise ConfigError("structured_outputs", f"the {_kind(spec)} matches no text at all" if
                              error.startswith("NoExtensionBias") else f"invalid {_kind(spec)}: {error}")
        if not matcher.is_accepting() and set(allowed.tolist()) <= self._stop_ids:
            raise ConfigError("structured_outputs", f"the {_kind(spec)} admits no text the model can write (its "
                                                    "first token would have to end the reply)")

    @functools.cached_property
    def _stop_ids(self) -> frozenset[int]:
        return frozenset(self._tokenizer.eos_token_ids)

    @functools.cached_property
    def _special_texts(self) -> tuple[str, ...]:
        """The text of each special token: a model writes it only as that token, which no grammar's text allows."""
        return tuple(sorted(text for i in self._tokenizer.special_token_ids
                            if len(text := self._tokenizer.decode([i], skip_special_tokens=False)) > 1))

    @functools.cached_property
    def _start_id(self) -> int | None:
        """The opening tag's token; an optional opening is told by the first token alone, so a tag that takes
        several tokens never opens."""
        start = self._tokenizer.encode(reasoning_tags.START, add_special_tokens=False)
        return start[0] if len(start) == 1 else None

    def _gate(self, reasoning: str) -> ReasoningGate:
        return ReasoningGate(reasoning_tags.opens_in_prompt(reasoning), self._start_id,
                             lambda ids: self._tokenizer.decode(ids, skip_special_tokens=False))


def short_error(message: str) -> str:
    """llguidance's error without the parser state and grammar it may append: the first line, capped. A first line
    that ends in a colon heads its detail (a regex's: the pattern, a caret under the fault, the reason), which is
    joined onto it."""
    lines = [line.strip() for line in message.strip().split("\n") if line.strip()]
    first = lines[0] if lines else ""
    if first.endswith(":"):
        first = " ".join(lines[:4])
    return first if len(first) <= MAX_ERROR_CHARS else first[:MAX_ERROR_CHARS - 3] + "..."


@functools.cache
def _limits() -> llguidance.LLParserLimits:
    import llguidance

    # Errors without llguidance's dump of parser state and grammar (the client's own text, at length); a row as
    # wide as the alternatives a rule may have, and the few items around them.
    return llguidance.LLParserLimits(verbose_errors=False, max_items_in_row=MAX_GRAMMAR_ALTERNATIVES + 16)


def _kind(spec: StructuredOutputs) -> str:
    if spec.json is not None:
        return "JSON schema"
    return "json_object" if spec.json_object else "regex" if spec.regex else "choice" if spec.choice else "grammar"
