"""The output processor: engine deltas in, StreamEvents out.

A delta brings 0..k tokens of one choice (k > 1 where the engine decodes speculatively). Each token is taken in
turn: detokenized (never half a UTF-8 character), split between the reasoning section and the answer, and
checked for stop strings (once ``min_tokens`` are out) and ``max_tokens``. A choice that ends inside a delta
ends at that token: the tokens after it are dropped, never streamed, and the engine is told to drop the request.
Then one StreamEvent per delta carries the text safe to stream (a possible stop string's start is held back),
its reasoning and answer parts, the tokens kept with their logprobs, and on the request's last event its usage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pocketllm.backend import RequestDelta, SampledLogprobs, TokenLogprob
from pocketllm.detokenizer import IncrementalDetokenizer, StopMatcher
from pocketllm.errors import EngineDeadError, GrammarError, RequestFailedError
from pocketllm.outputs import StreamEvent, Usage
from pocketllm.pooling import EmbeddingOutput, PoolingParams
from pocketllm.reasoning import ReasoningSplitter
from pocketllm.sampling_params import SamplingParams
from pocketllm.structured import Constraint, short_error

log = logging.getLogger(__name__)

MAX_STRAY_REQUESTS = 64
"""Requests an engine may send one delta out of turn for before the core takes it for broken."""

Sink = Callable[[StreamEvent | EmbeddingOutput | BaseException], None]
"""Fed a generation's StreamEvents, or an embedding request's one EmbeddingOutput (a StreamEvent with
finish_reason "abort" if it was cancelled); an exception ends either."""


@dataclass(slots=True)
class ChoiceState:
    """One of a request's ``n`` choices: one engine request, and the text made of its tokens so far."""

    index: int
    backend_id: str  # its engine request id
    detok: IncrementalDetokenizer
    constraint: Constraint | None = None
    text: str = ""
    num_emitted_chars: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # With SamplingParams.reasoning: `split` follows the text token by token (its answer is where stop strings
    # are looked for, unless stop_in_reasoning), `streamed` the text as it is streamed (each event's parts).
    split: ReasoningSplitter | None = None
    streamed: ReasoningSplitter | None = None
    answer: str = ""
    num_reasoning_tokens: int = 0  # tokens up to the one that closed the section
    # With SamplingParams.prompt_logprobs: the prompt's, once the engine scored it, until an event carries them.
    prompt_logprobs: list[SampledLogprobs | None] | None = None

    @property
    def reasoning_tokens(self) -> int | None:
        """Tokens of the reasoning section: all of them while it is open, none without one."""
        if self.split is None:
            return None
        if not self.split.has_section:
            return 0
        return self.num_reasoning_tokens if self.split.closed else len(self.token_ids)


@dataclass(slots=True)
class RequestState:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    stop: StopMatcher
    choices: list[ChoiceState]
    pooling: PoolingParams | None = None  # an embedding request: one choice, no tokens

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> Usage:
        reasoning = [c.reasoning_tokens for c in self.choices]
        return Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=sum(len(c.token_ids) for c in self.choices),
                     reasoning_tokens=None if None in reasoning else sum(r or 0 for r in reasoning))


def new_choice(index: int, backend_id: str, detok: IncrementalDetokenizer, params: SamplingParams,
               constraint: Constraint | None = None) -> ChoiceState:
    reasoning = params.reasoning
    return ChoiceState(index, backend_id, detok, constraint,
                       split=ReasoningSplitter(reasoning) if reasoning else None,
                       streamed=ReasoningSplitter(reasoning) if reasoning else None)


class OutputProcessor:
    """Turns each step's deltas into events for the requests' sinks (engine thread only).

    ``finished(request, choice)`` is called as each choice ends, ``forget(request)`` once a request holds nothing."""

    def __init__(self, finished: Callable[[RequestState, ChoiceState], None],
                 forget: Callable[[RequestState], None], backend: str = "?", vocab_size: int | None = None) -> None:
        self._finished, self._forget, self._backend, self._vocab_size = finished, forget, backend, vocab_size
        self.choices: dict[str, tuple[RequestState, ChoiceState]] = {}  # running choices by engine request id
        self.num_stray_deltas = 0  # deltas the engine sent for requests it had finished or been told to abort
        self._stray_ids: set[str] = set()
        self._gone: list[RequestState] = []  # requests whose sink raised: nobody reads them any more

    def process(self, deltas: list[RequestDelta]) -> list[str]:
        """Emit the events of one step; returns the engine requests to abort (a stop string matched, a request
        failed: its other choices)."""
        to_abort: list[str] = []
        for delta in deltas:
            entry = self.choices.get(delta.request_id)
            if entry is None and delta.request_id in to_abort:
                continue  # a sibling choice of a request that failed earlier in this step
            if entry is None:  # the engine broke its contract; the tokens have no one to go to
                self._stray(delta.request_id)
                continue
            request, choice = entry
            if delta.finish_reason == "error":
                to_abort += self.fail(request, delta.error or "the engine failed this request")
            elif request.pooling is not None:
                if not self._emit_embedding(request, choice, delta):
                    to_abort.append(choice.backend_id)
            elif (broken := _malformed(delta, self._vocab_size) or _unscored(request, choice, delta)) is not None:
                to_abort += self.fail(request, f"backend {self._backend!r}: {broken}")
            else:
                if request.params.prompt_logprobs is not None and not choice.token_ids and delta.new_token_ids:
                    choice.prompt_logprobs = [None, *(delta.prompt_logprobs or [])]
                kept = self._take(request, choice, delta)
                if choice.finish_reason is not None and delta.finish_reason is None:
                    to_abort.append(choice.backend_id)  # it ended in the core: the engine must drop it
                self.emit(request, choice, delta.new_token_ids[:kept],
                          None if delta.logprobs is None else delta.logprobs[:kept])
        gone, self._gone = self._gone, []
        for request in gone:
            to_abort += self.cancel(request)
        return to_abort

    def _stray(self, request_id: str) -> None:
        """One delta out of turn is logged; an engine that goes on sending them for a request (it never dropped
        it), or sends many, is broken: it would flood the log and keep the engine thread busy for ever."""
        self.num_stray_deltas += 1
        if request_id in self._stray_ids or len(self._stray_ids) >= MAX_STRAY_REQUESTS:
            raise EngineDeadError(f"backend {self._backend!r} went on sending deltas for request {request_id}, "
                                  "which it had finished or was told to abort (it broke the engine contract)")
        self._stray_ids.add(request_id)
        log.warning("backend %r sent a delta for request %s, which it had finished or was told to abort",
                    self._backend, request_id)

    def cancel(self, request: RequestState) -> list[str]:
        """End a request's running choices with finish_reason "abort"; returns their engine ids, to drop."""
        running = [c for c in request.choices if c.finish_reason is None]
        for choice in running:
            choice.finish_reason = "abort"
            self.emit(request, choice, [], None)
        return [c.backend_id for c in running]

    def _take(self, request: RequestState, choice: ChoiceState, delta: RequestDelta) -> int:
        """Take a delta's tokens in turn, until the choice ends; returns how many were kept."""
        tokens, params = delta.new_token_ids, request.params
        if params.max_tokens == 0 and tokens:  # it only scores its prompt: the engine's one token is dropped
            choice.finish_reason = "length"
            return 0
        if not tokens and delta.finish_reason is not None:  # an end between tokens: what was held back is out
            piece = choice.detok.flush()
            choice.text += piece
            self._split(choice, piece, True, stops_in_answer=not params.stop_in_reasoning)
            choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_token_id
        for i, token in enumerate(tokens):
            ends = i == len(tokens) - 1 and delta.finish_reason is not None
            choice.token_ids.append(token)
            piece = choice.detok.add([token])
            if ends:
                piece += choice.detok.flush()
                choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_token_id
            choice.text += piece
            searched, num_new = self._split(choice, piece, ends, stops_in_answer=not params.stop_in_reasoning)
            # As in vLLM, stop strings wait for min_tokens, like EOS and stop tokens in the engine.
            checks_stop = num_new and request.stop.stops and len(choice.token_ids) >= params.min_tokens
            hit = request.stop.find(searched, num_new) if checks_stop else None
            if hit is not None:
                # The match ends the text (the answer ends it too: nothing is held back once it has begun).
                choice.text = choice.text[:len(choice.text) - len(searched) + hit[0]]
                choice.finish_reason, choice.stop_reason = "stop", hit[1]
                return i + 1
            if ends:
                return i + 1
            if len(choice.token_ids) >= params.max_tokens:  # an engine that overran its budget is held to it
                choice.text += choice.detok.flush()
                choice.finish_reason = "length"
                return i + 1
        return len(tokens)

    @staticmethod
    def _split(choice: ChoiceState, piece: str, ends: bool, *, stops_in_answer: bool) -> tuple[str, int]:
        """Follow the reasoning section; returns the text stop strings are looked for and its new length."""
        if choice.split is None:
            return choice.text, len(piece)
        answer = choice.split.feed(piece)[1]
        if ends:
            answer += choice.split.finish()[1]
        if choice.split.closed and not choice.num_reasoning_tokens:
            choice.num_reasoning_tokens = len(choice.token_ids)
        choice.answer += answer
        return (choice.answer, len(answer)) if stops_in_answer else (choice.text, len(piece))

    def emit(self, request: RequestState, choice: ChoiceState, token_ids: list[int],
             logprobs: list[SampledLogprobs] | None) -> None:
        done = choice.finish_reason is not None
        end = len(choice.text) if done else max(choice.num_emitted_chars, request.stop.safe_length(choice.text))
        text, choice.num_emitted_chars = choice.text[choice.num_emitted_chars:end], end
        reasoning = answer = None
        if choice.streamed is not None:
            reasoning, answer = choice.streamed.feed(text)
            if done:
                held_reasoning, held_answer = choice.streamed.finish()
                reasoning, answer = reasoning + held_reasoning, answer + held_answer
        usage = None
        if done:
            self.choices.pop(choice.backend_id, None)
            self._finished(request, choice)
            if request.finished:
                usage = request.usage()
                self._forget(request)
        prompt_logprobs, choice.prompt_logprobs = choice.prompt_logprobs, None
        event = StreamEvent(request_id=request.request_id, index=choice.index, text=text, token_ids=list(token_ids),
                            logprobs=logprobs, finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                            reasoning=reasoning, answer=answer,
                            reasoning_tokens=choice.reasoning_tokens if done else None, usage=usage,
                            prompt_logprobs=prompt_logprobs)
        try:
            request.sink(event)
        except Exception:  # the consumer went away (e.g. its event loop closed): stop generating for it
            log.warning("dropping request %s: its consumer is gone", request.request_id)
            if not done:
                self._gone.append(request)

    def _emit_embedding(self, request: RequestState, choice: ChoiceState, delta: RequestDelta) -> bool:
        """Hand over an embedding; False when the engine sent none (the request failed; the engine must drop it)."""
        if delta.embedding is None or delta.finish_reason is None:  # the engine broke its contract
            self.fail(request, "the engine answered an embedding request without an embedding")
            return False
        choice.finish_reason = "stop"
        self.choices.pop(choice.backend_id, None)
        self._finished(request, choice)
        self._forget(request)
        try:
            request.sink(EmbeddingOutput(request_id=request.request_id, embedding=delta.embedding,
                                         prompt_token_ids=request.prompt_ids))
        except Exception:
            log.warning("dropping the embedding of request %s: its consumer is gone", request.request_id)
        return True

    def fail(self, request: RequestState, message: str) -> list[str]:
        """End a request the engine failed: its caller gets the error; returns its other choices to abort."""
        error = _failure(request, message)
        if isinstance(error, GrammarError):  # the client's doing, as a refused request is
            log.info("request %s failed in the engine: %s", request.request_id, error)
        else:
            log.error("request %s failed in the engine: %s", request.request_id, message)
        others = [c.backend_id for c in request.choices if c.finish_reason is None]
        for choice in request.choices:
            self.choices.pop(choice.backend_id, None)
            choice.finish_reason = choice.finish_reason or "error"
        self._forget(request)
        try:
            request.sink(error)
        except Exception:
            log.warning("could not tell request %s that it failed", request.request_id)
        return others


def _malformed(delta: RequestDelta, vocab_size: int | None) -> str | None:
    """Why a delta's tokens or logprobs are not what the contract says (Python ints in the vocabulary, Python
    floats), or None. A NumPy scalar (the usual slip of an engine written in NumPy) would reach users as such, and
    fail the server's JSON encoding in the middle of a reply."""
    ids = delta.new_token_ids
    if not isinstance(ids, list) or any(type(t) is not int for t in ids):
        kinds = sorted({type(t).__name__ for t in ids} - {"int"}) if isinstance(ids, list) else [type(ids).__name__]
        return f"its new_token_ids must be a list of Python ints, got {', '.join(kinds)}"
    if ids and vocab_size is not None and not (min(ids) >= 0 and max(ids) < vocab_size):
        return f"it sent token id {min(ids) if min(ids) < 0 else max(ids)}, outside the vocabulary [0, {vocab_size})"
    for entry in delta.logprobs or ():  # the first alternative stands for the rest of its list
        if not (isinstance(entry, SampledLogprobs) and isinstance(entry.top, list)
                and all(isinstance(t, TokenLogprob) and type(t.logprob) is float for t in entry.top[:1])):
            return "its logprobs must be SampledLogprobs whose top is a list of TokenLogprob"
        if type(entry.logprob) is not float:
            return f"its logprobs must be Python floats, got {type(entry.logprob).__name__}"
    return None


def _unscored(request: RequestState, choice: ChoiceState, delta: RequestDelta) -> str | None:
    """Why a choice's first tokens break the prompt-logprobs contract (a backend that declares the option must send
    one entry per prompt token after the first with them), or None: a request is failed, never silently unscored."""
    if request.params.prompt_logprobs is None or choice.token_ids or not delta.new_token_ids:
        return None
    got = len(delta.prompt_logprobs or [])  # a one-token prompt has none to send
    if got == len(request.prompt_ids) - 1:
        return None
    return (f"the engine sent {got or 'no'} prompt logprobs with the first token of a {len(request.prompt_ids)}-token "
            "prompt, whose prompt_logprobs it declares")


def _failure(request: RequestState, message: str) -> RequestFailedError:
    """Why the engine failed ``request``: a GrammarError where its grammar (with min_tokens) left no token to
    sample, which is the request's doing; else the engine's message."""
    engine = short_error(message)
    for choice in request.choices:
        constraint, n = choice.constraint, len(choice.token_ids)
        if constraint is None:
            continue
        if constraint.complete and n < request.params.min_tokens:
            return GrammarError("min_tokens", f"the grammar was complete after {n} tokens, where only the end of "
                                f"the reply may come, which min_tokens={request.params.min_tokens} bans ({engine})")
        if constraint.error is not None:
            return GrammarError("structured_outputs", f"the grammar allowed no token the model could sample after "
                                f"{n} tokens ({engine})")
    return RequestFailedError(f"request {request.request_id} failed: {message}")
