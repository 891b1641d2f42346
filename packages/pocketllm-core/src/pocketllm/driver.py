"""The engine driver: the core's one handle on a running engine, used by LLM and AsyncLLM from any thread.

Start-up is in :mod:`pocketllm.startup`, the step loop and its command queue in :mod:`pocketllm.engine_loop`,
and the turning of deltas into text in :mod:`pocketllm.output_processor`. Here requests are checked, their
grammars compiled and their choices made, before they are queued.
"""

from __future__ import annotations

import logging
import threading
import uuid
import weakref
from concurrent.futures import Future

from pocketllm.args import EngineArgs
from pocketllm.backend import BackendStats, Engine
from pocketllm.capability_checks import check_embedding_request, check_request
from pocketllm.detokenizer import IncrementalDetokenizer, StopMatcher
from pocketllm.engine_loop import EngineLoop
from pocketllm.errors import BrokenBackendError, CheckpointError, PocketLLMError
from pocketllm.output_processor import ChoiceState, RequestState, Sink, new_choice
from pocketllm.plugins import BackendRegistry
from pocketllm.pooling import PoolingParams
from pocketllm.progress import LoadProgress
from pocketllm.sampling_params import SamplingParams
from pocketllm.startup import (
    ChosenBackend,
    LoadedModel,
    await_built,
    build_engine,
    choose_backend,
    read_model,
    start_ranks,
)
from pocketllm.structured import CompiledGrammar, Constraint, GrammarCompiler

__all__ = ["EngineDriver", "Sink"]

log = logging.getLogger(__name__)


class EngineDriver:
    """Loads a model on the selected backend and serves requests from any thread."""

    def __init__(self, args: EngineArgs, registry: BackendRegistry | None = None,
                 progress: LoadProgress | None = None) -> None:
        progress = progress or LoadProgress()
        model = read_model(args, progress)
        self.registry = registry or BackendRegistry()
        self.args, self.model_config, self.tokenizer = model.args, model.checkpoint.config, model.tokenizer
        self.checkpoint_path, self.sampling_defaults = model.checkpoint.path, model.sampling_defaults
        self.default_pooling = model.default_pooling
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                        cache_bytes=self.args.grammar_cache_mb << 20)
        failed: BrokenBackendError | None = None
        while True:
            try:
                backend = choose_backend(model, self.registry, progress)
            except PocketLLMError as e:
                if failed is None:
                    raise
                raise e from failed  # no backend is left: say why the one tried last failed too
            try:
                self._start(model, backend, progress)
                break
            except BrokenBackendError as e:
                # Under "auto", a backend whose create_engine failed (a bug, a runtime it could not import) is
                # recorded as broken and the next one serves, as when its capabilities() fails. A backend the
                # user named stays an error, and so does any under tensor parallelism: the other ranks (started
                # here or by a launcher) are running the first backend's workers.
                if args.backend != "auto" or e.backend != backend.plugin.name or args.tensor_parallel_size != 1:
                    raise
                self.registry.engine_failed(e)
                _drop_tracebacks(e)
                failed = e
        # A script may exit without shutdown() (the README's does). The engine thread is a daemon: left to the
        # interpreter's teardown, it is frozen mid-step or with the backend's objects alive (nanobind reports them
        # as leaks; a step under way aborts the process). Stop it in order at exit, while the interpreter is whole;
        # the hook holds the driver weakly, so that it keeps nothing alive.
        weakref.finalize(self, _shutdown_if_alive, weakref.ref(self))
        self.registry.pm.hook.pocketllm_engine_started(args=self.args, backend_name=self.backend_name)
        progress.done(f"{self.model_config.architecture} model on backend {self.backend_name} "
                      f"(max_model_len {self.max_model_len})")

    def _start(self, model: LoadedModel, backend: ChosenBackend, progress: LoadProgress) -> None:
        """Build ``backend``'s engine on the engine thread, which then runs its loop; raises what the build raised."""
        self.backend_name, self.capabilities = backend.plugin.name, backend.capabilities
        self._loop = EngineLoop(self.backend_name, self.args.max_num_seqs, self._choice_finished,
                                self.model_config.vocab_size)
        self._ranks = start_ranks(self.args, backend.plugin)
        built: Future[None] = Future()
        self._thread = threading.Thread(target=self._run, args=(model, backend, built), name="pocketllm-engine",
                                        daemon=True)
        with progress.stage(f"loading the weights on backend {self.backend_name}"):
            self._thread.start()
            try:
                await_built(built, self._ranks)
            except BaseException:
                if self._ranks is not None:
                    self._thread.join(timeout=5)  # its wait for the ranks ends: the next engine may start
                raise

    def _run(self, model: LoadedModel, backend: ChosenBackend, built: Future[None]) -> None:
        # The engine is built on the thread that steps it: torch's OpenMP thread team belongs to the thread
        # that created it, and stepping from another thread measured ~40% slower on 2 cores.
        try:
            engine = build_engine(model, backend)
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(None)
        self._loop.run(engine)

    @property
    def max_model_len(self) -> int:
        assert self.args.max_model_len is not None
        return self.args.max_model_len

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Refuse what ``add_request`` would refuse before its grammar compiles (capability_checks.check_request)."""
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
        choices = [new_choice(i, request_id if params.n == 1 else f"{request_id}-{i}", self._detokenizer(
                   prompt_ids, params.skip_special_tokens), params, constraints[i]) for i in range(params.n)]
        request = RequestState(request_id, list(prompt_ids), params, sink,
                               StopMatcher(params.stop, params.include_stop_str_in_output), choices)
        return request_id, self._loop.submit(request)

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
        choice = ChoiceState(0, request_id, self._detokenizer(prompt_ids, True))
        request = RequestState(request_id, list(prompt_ids), SamplingParams(max_tokens=1), sink,
                               StopMatcher([], False), [choice], pooling=params)
        return request_id, self._loop.submit(request)

    def _detokenizer(self, prompt_ids: list[int], skip_special_tokens: bool) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens)

    def abort(self, request_id: str) -> None:
        """Cancel at the next step boundary; the request's sink gets final ``abort`` events."""
        self._loop.abort(request_id)

    def stats(self) -> BackendStats:
        """The engine's counters as of its latest step (see EngineLoop.stats)."""
        return self._loop.stats()

    @property
    def engine(self) -> Engine:
        """The backend's engine, for tests and benchmarks that look inside it: only the engine thread calls it."""
        return self._loop.engine

    @property
    def num_stray_deltas(self) -> int:
        """Deltas the engine sent for requests it had finished or been told to abort (a broken contract)."""
        return self._loop.outputs.num_stray_deltas

    @property
    def error(self) -> BaseException | None:
        """What killed the engine loop, if it died."""
        return self._loop.error

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._loop.error is None

    def shutdown(self) -> None:
        self._loop.close()
        self.grammars.close()
        if self._thread is not threading.current_thread():
            self._thread.join()
            if self._ranks is not None:  # the engine's shutdown ended their loops
                self._ranks.close()
                self._ranks = None

    def _choice_finished(self, request: RequestState, choice: ChoiceState) -> None:
        self.registry.request_finished(request_id=choice.backend_id, finish_reason=choice.finish_reason,
                                       num_prompt_tokens=len(request.prompt_ids),
                                       num_completion_tokens=len(choice.token_ids))


def _drop_tracebacks(error: BaseException) -> None:
    """Let go of the frames behind ``error`` and its causes, keeping their messages: a failed build's frames hold its
    partial allocations (and the future holding ``error``, a cycle), which must not stay while the next backend
    loads."""
    seen: set[int] = set()
    link: BaseException | None = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        link.__traceback__ = None
        link = link.__cause__ or link.__context__


def _shutdown_if_alive(driver: weakref.ref[EngineDriver]) -> None:
    alive = driver()
    if alive is not None:
        alive.shutdown()
