"""The engine driver: owns one backend engine and runs its step loop on a thread.

Callers submit requests with a *sink* (a callable fed StreamEvents, or an
exception if the engine dies). The loop applies queued adds and aborts at step
boundaries, steps the backend, and turns its token deltas into text: UTF-8
safe detokenization, stop strings, usage.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import msgspec

from pocketllm.args import EngineArgs, resolve_max_model_len
from pocketllm.backend import (
    BackendPlugin,
    BackendStats,
    EmbeddingEngine,
    RequestDelta,
    SampledLogprobs,
    TensorParallelBackend,
)
from pocketllm.checkpoint import Checkpoint, load_checkpoint
from pocketllm.checkpoint.shapes import check_model
from pocketllm.detokenizer import IncrementalDetokenizer, StopMatcher
from pocketllm.errors import (
    CheckpointError,
    ConfigError,
    EngineDeadError,
    GrammarError,
    RequestFailedError,
    UnsupportedOptionError,
)
from pocketllm.outputs import StreamEvent, Usage
from pocketllm.plugins import BackendRegistry
from pocketllm.pooling import DEFAULT_POOLING_TYPE, EmbeddingOutput, PoolingParams
from pocketllm.progress import LoadProgress
from pocketllm.reasoning import ReasoningSplitter
from pocketllm.sampling_defaults import recommended_defaults
from pocketllm.sampling_params import SamplingParams
from pocketllm.structured import CompiledGrammar, Constraint, GrammarCompiler, short_error
from pocketllm.support import check_embedding_request, check_engine_args, check_request
from pocketllm.tensor_parallel import LocalRanks, check_world, rank_info
from pocketllm.tokenizer import Tokenizer
from pocketllm.warmup import warm_up

log = logging.getLogger(__name__)

Sink = Callable[[StreamEvent | EmbeddingOutput | BaseException], None]
"""Fed a generation's StreamEvents, or an embedding request's one EmbeddingOutput (a StreamEvent with
finish_reason "abort" if it was cancelled); an exception ends either."""


@dataclass(slots=True)
class _Choice:
    index: int
    backend_id: str
    detok: IncrementalDetokenizer
    text: str = ""
    num_emitted_chars: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[SampledLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    constraint: Constraint | None = None
    # With SamplingParams.reasoning (and not stop_in_reasoning): the answer after the section, where stop strings
    # are looked for.
    splitter: ReasoningSplitter | None = None
    answer: str = ""


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    stop: StopMatcher
    choices: list[_Choice]
    pooling: PoolingParams | None = None  # an embedding request: one choice, no tokens

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=sum(len(c.token_ids) for c in self.choices))


class EngineDriver:
    """Loads a model on the selected backend and serves requests from any thread."""

    def __init__(self, args: EngineArgs, registry: BackendRegistry | None = None,
                 progress: LoadProgress | None = None) -> None:
        progress = progress or LoadProgress()
        with progress.stage(f"reading {args.model}"):
            checkpoint = load_checkpoint(args.model, args.model_format)
            check_model(checkpoint)  # a tensor missing or a layer count the tensors do not bear out
            self.args = dataclasses.replace(args, max_model_len=resolve_max_model_len(args, checkpoint.config))
            self.model_config = checkpoint.config
            self.checkpoint_path = checkpoint.path
            self.sampling_defaults = recommended_defaults(checkpoint)
            self.default_pooling = _pooling_of(checkpoint)
            self.tokenizer = Tokenizer.from_checkpoint(checkpoint)
        # After the checkpoint: "auto" picks among the backends that can serve this model with these options.
        with progress.stage("finding a backend" if args.backend == "auto" else f"starting backend {args.backend}"):
            self.registry = registry or BackendRegistry()
            plugin = self.registry.select(self.args, checkpoint)
            self.backend_name = plugin.name
            self.capabilities = plugin.capabilities()
            self.backend_options = check_engine_args(plugin.name, self.capabilities, self.args, checkpoint)

        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                        cache_bytes=self.args.grammar_cache_mb << 20)
        self._cond = threading.Condition()
        self._commands: list[tuple[str, object, Future[None] | None]] = []
        self._requests: dict[str, _Request] = {}  # every request added and not finished, by request id
        self._backend_ids: set[str] = set()  # the engine request ids of those requests' choices
        self.num_stray_deltas = 0  # deltas the engine sent for requests it had finished or been told to abort
        self._choices: dict[str, tuple[_Request, _Choice]] = {}  # by backend id; engine thread only
        self._stats = BackendStats()
        self._error: BaseException | None = None
        self._closing = False
        # A library engine split across ranks starts its other ranks itself (a launcher has set RANK otherwise).
        self._ranks = None
        if self.args.tensor_parallel_size > 1:
            if not isinstance(plugin, TensorParallelBackend) or plugin.api_version < (2, 2):
                raise UnsupportedOptionError("tensor_parallel_size", plugin.name, "it declares tensor parallelism "
                                             "without contract 2.2's run_tp_worker (TensorParallelBackend)")
            rank = rank_info()
            if rank is None or LocalRanks.active:
                self._ranks = LocalRanks(self.args)
            else:
                check_world(self.args, rank)
                if rank.rank != 0:
                    raise ConfigError("tensor_parallel_size", f"this process is rank {rank.rank}: ranks other than 0 "
                                      "serve through pocketllm.tensor_parallel.run_worker(args), not an engine")
        built: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(plugin, checkpoint, built), name="pocketllm-engine",
                                        daemon=True)
        with progress.stage(f"loading the weights on backend {plugin.name}"):
            self._thread.start()
            try:
                # A rank that dies before joining would leave rank 0 waiting to meet it: watch them meanwhile.
                while not wait([built], timeout=0.2).done:
                    failure = self._ranks.failure() if self._ranks is not None else None
                    if failure is not None:
                        raise EngineDeadError(f"tensor-parallel {failure}")
                built.result()  # re-raises whatever create_engine raised
            except BaseException:
                if self._ranks is not None:
                    self._ranks.abandon()
                    self._thread.join(timeout=5)  # its wait for the ranks ends: the next engine may start
                raise
        # A script may exit without shutdown() (the README's does). The engine thread is a daemon: left to the
        # interpreter's teardown, it is frozen mid-step or with the backend's objects alive (nanobind reports them
        # as leaks; a step under way aborts the process). Stop it in order at exit, while the interpreter is whole;
        # the hook holds the driver weakly, so that it keeps nothing alive.
        weakref.finalize(self, _shutdown_if_alive, weakref.ref(self))
        self.registry.pm.hook.pocketllm_engine_started(args=self.args, backend_name=plugin.name)
        progress.done(f"{checkpoint.config.architecture} model on backend {plugin.name} "
                      f"(max_model_len {self.max_model_len})")

    @property
    def max_model_len(self) -> int:
        assert self.args.max_model_len is not None
        return self.args.max_model_len

    # -- called from any thread ------------------------------------------------

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Refuse what ``add_request`` would refuse before its grammar compiles (see support.check_request)."""
        return check_request(self.backend_name, self.capabilities, prompt_ids, params,
                             vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len)

    def add_request(self, prompt_ids: list[int], params: SamplingParams, sink: Sink,
                    request_id: str | None = None, grammar: CompiledGrammar | None = None) -> tuple[str, Future[None]]:
        """Queue a request; the future resolves once the backend accepted it (or holds its error). ``grammar`` is
        its ``structured_outputs`` already compiled (``self.grammars.compile_async``); else it compiles here,
        blocking the caller (never the engine's steps) on the compile threads."""
        params = self.check_request(prompt_ids, params)
        request_id = request_id or uuid.uuid4().hex
        constraints: list[Constraint | None] = [None] * params.n
        if params.structured_outputs is not None:
            grammar = grammar or self.grammars.compile(params.structured_outputs)
            constraints = [self.grammars.constraint(grammar, params.reasoning) for _ in range(params.n)]
        # Stop strings look past the reasoning section unless asked not to.
        splits = None if params.stop_in_reasoning or not params.stop else params.reasoning
        choices = [
            _Choice(i, request_id if params.n == 1 else f"{request_id}-{i}",
                    IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens),
                    constraint=constraints[i],
                    splitter=ReasoningSplitter(splits) if splits else None)
            for i in range(params.n)
        ]
        request = _Request(request_id, list(prompt_ids), params, sink,
                           StopMatcher(params.stop, params.include_stop_str_in_output), choices)
        return request_id, self._queue(request)

    def add_embedding(self, prompt_ids: list[int], params: PoolingParams, sink: Sink,
                      request_id: str | None = None) -> tuple[str, Future[None]]:
        """Queue an embedding request; its sink gets one EmbeddingOutput (see ``add_request`` for the future)."""
        if params.pooling_type is None and isinstance(self.default_pooling, CheckpointError):
            raise self.default_pooling
        params = check_embedding_request(self.backend_name, self.capabilities, prompt_ids, params,
                                         vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
                                         hidden_size=self.model_config.hidden_size,
                                         default_pooling=str(self.default_pooling))
        request_id = request_id or uuid.uuid4().hex
        choice = _Choice(0, request_id, IncrementalDetokenizer(self.tokenizer, prompt_ids, True))
        request = _Request(request_id, list(prompt_ids), SamplingParams(max_tokens=1), sink, StopMatcher([], False),
                           [choice], pooling=params)
        return request_id, self._queue(request)

    def _queue(self, request: _Request) -> Future[None]:
        request_id, choices = request.request_id, request.choices
        future: Future[None] = Future()
        with self._cond:
            if self._error is not None or self._closing:
                raise EngineDeadError(f"engine is not running: {self._error or 'shut down'}")
            backend_ids = {c.backend_id for c in choices}
            if request_id in self._requests or not backend_ids.isdisjoint(self._backend_ids):
                raise ConfigError("request_id", f"{request_id!r} is already in use")
            self._requests[request_id] = request
            self._backend_ids |= backend_ids
            self._commands.append(("add", request, future))
            self._cond.notify()
        return future

    def abort(self, request_id: str) -> None:
        """Cancel at the next step boundary; the request's sink gets final ``abort`` events."""
        with self._cond:
            # The request itself is queued, not its id: a client-chosen id may be reused by a new request
            # before this abort is applied, and that request must not be cancelled by it.
            request = self._requests.get(request_id)
            if request is not None:
                self._commands.append(("abort", request, None))
                self._cond.notify()

    def stats(self) -> BackendStats:
        """The engine's counters as of its latest step, with ``num_waiting`` counting what waits for a slot.

        The engine counts its own queue only after a step; requests handed to it since then count as waiting
        for whatever they add beyond ``max_num_seqs`` slots, so that a burst is counted as it arrives."""
        stats = self._stats
        with self._cond:
            queued = sum(len(item.choices) for kind, item, _ in self._commands if kind == "add")  # type: ignore[attr-defined]
        waiting = max(stats.num_waiting, stats.num_running + stats.num_waiting + queued - self.args.max_num_seqs)
        return msgspec.structs.replace(stats, num_waiting=waiting)

    @property
    def error(self) -> BaseException | None:
        """What killed the engine loop, if it died."""
        return self._error

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def shutdown(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self.grammars.close()
        if self._thread is not threading.current_thread():
            self._thread.join()
            if self._ranks is not None:  # the engine's shutdown ended their loops
                self._ranks.close()
                self._ranks = None

    # -- engine thread ---------------------------------------------------------

    def _run(self, plugin: BackendPlugin, checkpoint: Checkpoint, built: Future[None]) -> None:
        # The engine is built on the thread that steps it: torch's OpenMP thread team belongs to the thread
        # that created it, and stepping from another thread measured ~40% slower on 2 cores.
        try:
            self.engine = plugin.create_engine(self.args, checkpoint, self.backend_options)
        except BaseException as e:
            built.set_exception(e)
            return
        try:
            warm_up(self.engine, self.capabilities, self.model_config, checkpoint.path)
        except BaseException as e:  # a model that computes NaN is refused at load, its engine closed
            self.engine.shutdown()
            built.set_exception(e)
            return
        built.set_result(None)
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._closing or self.engine.has_unfinished()):
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    closing = self._closing
                for kind, item, future in commands:
                    self._add(item, future) if kind == "add" else self._abort(item)  # type: ignore[arg-type]
                if closing:
                    self._abort_all()
                    break
                if self.engine.has_unfinished():
                    deltas = self.engine.step()
                    self._stats = self.engine.stats()  # fresh before callers see this step's events
                    self._dispatch(deltas)
                self._stats = self.engine.stats()
        except BaseException as e:  # the backend failed: every caller must hear about it
            log.exception("engine loop died")
            self._die(e)
        finally:
            self.engine.shutdown()

    def _add(self, request: _Request, future: Future[None]) -> None:
        added: list[str] = []
        try:
            for choice in request.choices:
                if request.pooling is not None:
                    if not isinstance(self.engine, EmbeddingEngine):
                        raise UnsupportedOptionError("embeddings", self.backend_name, "it declares pooling_types "
                                                     "without contract 2.4's add_embedding_request")
                    self.engine.add_embedding_request(choice.backend_id, request.prompt_ids, request.pooling)
                    added.append(choice.backend_id)
                    self._choices[choice.backend_id] = (request, choice)
                    continue
                seed = request.params.seed
                params = msgspec.structs.replace(
                    request.params, n=1, seed=None if seed is None else _wrap_int64(seed + choice.index))
                if choice.constraint is None:
                    self.engine.add_request(choice.backend_id, request.prompt_ids, params)
                else:
                    self.engine.add_request(choice.backend_id, request.prompt_ids, params,
                                            constraint=choice.constraint)
                added.append(choice.backend_id)
                self._choices[choice.backend_id] = (request, choice)
        except Exception as e:
            self.engine.abort(added)
            for backend_id in added:
                del self._choices[backend_id]
            self._forget(request)
            _settle(future, e)
            return
        _settle(future, None)

    def _abort(self, request: _Request) -> None:
        if self._requests.get(request.request_id) is not request:
            return  # already finished
        running = [c for c in request.choices if c.finish_reason is None]
        self.engine.abort([c.backend_id for c in running])
        for choice in running:
            choice.finish_reason = "abort"
            self._emit(request, choice, [], None)

    def _abort_all(self) -> None:
        for request in list(self._requests.values()):
            self._abort(request)

    def _dispatch(self, deltas: list[RequestDelta]) -> None:
        to_abort: list[str] = []
        for delta in deltas:
            entry = self._choices.get(delta.request_id)
            if entry is None and delta.request_id in to_abort:
                continue  # a sibling choice of a request that failed earlier in this step
            if entry is None:  # the engine broke its contract; the tokens have no one to go to
                self.num_stray_deltas += 1
                log.warning("engine sent a delta for request %s, which it had finished or was told to abort",
                            delta.request_id)
                continue
            request, choice = entry
            if delta.finish_reason == "error":
                to_abort += self._fail(request, delta.error or "the engine failed this request")
                continue
            if request.pooling is not None:
                self._emit_embedding(request, choice, delta)
                continue
            choice.token_ids.extend(delta.new_token_ids)
            if delta.logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + delta.logprobs
            new_text = choice.detok.add(delta.new_token_ids)
            if delta.finish_reason is not None:
                new_text += choice.detok.flush()
                choice.finish_reason, choice.stop_reason = delta.finish_reason, delta.stop_token_id
            choice.text += new_text
            searched, num_new = choice.text, len(new_text)
            if choice.splitter is not None:  # stop strings apply to the answer after the reasoning section
                answer = choice.splitter.feed(new_text)[1]
                if delta.finish_reason is not None:
                    answer += choice.splitter.finish()[1]
                choice.answer += answer
                searched, num_new = choice.answer, len(answer)
            # As in vLLM, stop strings wait for min_tokens, like EOS and stop tokens in the engine.
            checks_stop = num_new and request.stop.stops and len(choice.token_ids) >= request.params.min_tokens
            hit = request.stop.find(searched, num_new) if checks_stop else None
            if hit is not None:
                # The answer ends the text: nothing is held back once it has begun.
                choice.text = choice.text[:len(choice.text) - len(searched) + hit[0]]
                if choice.finish_reason is None:
                    to_abort.append(choice.backend_id)
                choice.finish_reason, choice.stop_reason = "stop", hit[1]
            self._emit(request, choice, delta.new_token_ids, delta.logprobs)
        if to_abort:
            self.engine.abort(to_abort)

    def _emit(self, request: _Request, choice: _Choice, token_ids: list[int],
              logprobs: list[SampledLogprobs] | None) -> None:
        done = choice.finish_reason is not None
        end = len(choice.text) if done else max(choice.num_emitted_chars, request.stop.safe_length(choice.text))
        text, choice.num_emitted_chars = choice.text[choice.num_emitted_chars:end], end
        usage = None
        if done:
            self._choices.pop(choice.backend_id, None)
            self.registry.request_finished(
                request_id=choice.backend_id, finish_reason=choice.finish_reason,
                num_prompt_tokens=len(request.prompt_ids), num_completion_tokens=len(choice.token_ids))
            if request.finished:
                usage = request.usage()
                self._forget(request)
        event = StreamEvent(request_id=request.request_id, index=choice.index, text=text, token_ids=list(token_ids),
                            logprobs=logprobs, finish_reason=choice.finish_reason, stop_reason=choice.stop_reason,
                            usage=usage)
        try:
            request.sink(event)
        except Exception:  # the consumer went away (e.g. its event loop closed): stop generating for it
            log.warning("dropping request %s: its consumer is gone", request.request_id)
            if not done:
                self._abort(request)

    def _emit_embedding(self, request: _Request, choice: _Choice, delta: RequestDelta) -> None:
        if delta.embedding is None or delta.finish_reason is None:  # the engine broke its contract
            self._fail(request, "the engine answered an embedding request without an embedding")
            self.engine.abort([choice.backend_id])
            return
        choice.finish_reason = "stop"
        self._choices.pop(choice.backend_id, None)
        self.registry.request_finished(
            request_id=choice.backend_id, finish_reason="stop", num_prompt_tokens=len(request.prompt_ids),
            num_completion_tokens=0)
        self._forget(request)
        try:
            request.sink(EmbeddingOutput(request_id=request.request_id, embedding=delta.embedding,
                                         prompt_token_ids=request.prompt_ids))
        except Exception:
            log.warning("dropping the embedding of request %s: its consumer is gone", request.request_id)

    def _fail(self, request: _Request, message: str) -> list[str]:
        """End a request the engine failed: its caller gets the error; returns its other choices to abort."""
        error = _failure(request, message)
        if isinstance(error, GrammarError):  # the client's doing, as a refused request is
            log.info("request %s failed in the engine: %s", request.request_id, error)
        else:
            log.error("request %s failed in the engine: %s", request.request_id, message)
        others = [c.backend_id for c in request.choices if c.finish_reason is None]
        for choice in request.choices:
            self._choices.pop(choice.backend_id, None)
            choice.finish_reason = choice.finish_reason or "error"
        self._forget(request)
        try:
            request.sink(error)
        except Exception:
            log.warning("could not tell request %s that it failed", request.request_id)
        return others

    def _forget(self, request: _Request) -> None:
        with self._cond:
            if self._requests.get(request.request_id) is request:
                del self._requests[request.request_id]
            self._backend_ids.difference_update(c.backend_id for c in request.choices)

    def _die(self, error: BaseException) -> None:
        with self._cond:
            self._error = error
            requests, self._requests = list(self._requests.values()), {}
            commands, self._commands = self._commands, []
        dead = EngineDeadError(f"engine failed: {type(error).__name__}: {error}")
        for _, _, future in commands:
            if future is not None:
                _settle(future, dead)
        for request in requests:
            try:
                request.sink(dead)
            except Exception:
                log.warning("could not tell request %s that the engine died", request.request_id)


def _shutdown_if_alive(driver: weakref.ref[EngineDriver]) -> None:
    alive = driver()
    if alive is not None:
        alive.shutdown()


def _failure(request: _Request, message: str) -> RequestFailedError:
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


def _pooling_of(checkpoint: Checkpoint) -> str | CheckpointError:
    """The checkpoint's pooling for embeddings that name none; a broken pooling config is kept to be raised by
    those embeddings, not by loading a model that may only generate."""
    try:
        return checkpoint.pooling_type() or DEFAULT_POOLING_TYPE
    except CheckpointError as e:
        log.warning("%s: embeddings must name their pooling_type", e)
        return e


def _settle(future: Future[None], error: BaseException | None) -> None:
    """Resolve a caller's future unless the caller already cancelled it (it has gone away: nothing to tell)."""
    if future.set_running_or_notify_cancel():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _wrap_int64(value: int) -> int:
    """Keep per-choice seeds (``seed + index``) inside the signed 64-bit range seeds are validated to."""
    return (value + 2**63) % 2**64 - 2**63
