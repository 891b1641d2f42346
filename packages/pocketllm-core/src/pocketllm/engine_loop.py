"""The step loop: one thread that owns a backend engine, fed through a command queue.

Callers on any thread queue adds and aborts; the loop applies them at step boundaries, steps the engine, and
hands its deltas to the output processor. Each iteration reads::

    commands, closing = self._next_commands()   # waits while there is nothing to do
    for command in commands:
        self._apply(command)
    if closing:
        self._cancel_all(); break
    if engine.has_unfinished():
        deltas = engine.step()
        self.stats = engine.stats()
        engine.abort(self.outputs.process(deltas))
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec

from pocketllm.backend import BackendStats, EmbeddingEngine, Engine
from pocketllm.errors import ConfigError, EngineDeadError, UnsupportedOptionError
from pocketllm.output_processor import ChoiceState, OutputProcessor, RequestState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AddCommand:
    request: RequestState
    accepted: Future[None]  # resolved once the engine took every choice, or with why it did not


@dataclass(frozen=True, slots=True)
class AbortCommand:
    # The request itself, not its id: a client-chosen id may be reused by a new request before this abort is
    # applied, and that request must not be cancelled by it.
    request: RequestState


Command = AddCommand | AbortCommand


class EngineLoop:
    """Runs ``engine`` on the calling thread (:meth:`run`) until :meth:`close`; safe to call from any thread."""

    def __init__(self, backend_name: str, max_num_seqs: int,
                 finished: Callable[[RequestState, ChoiceState], None], vocab_size: int | None = None) -> None:
        self.backend_name = backend_name
        self._max_num_seqs = max_num_seqs
        self._cond = threading.Condition()
        self._commands: list[Command] = []
        self._requests: dict[str, RequestState] = {}  # every request added and not finished, by request id
        self._backend_ids: set[str] = set()  # the engine request ids of those requests' choices
        self._error: BaseException | None = None
        self._closing = False
        self.outputs = OutputProcessor(finished, self._forget, backend_name, vocab_size)
        self.stats_snapshot = BackendStats()  # the engine's counters as of its latest step

    # -- called from any thread ------------------------------------------------

    def submit(self, request: RequestState) -> Future[None]:
        accepted: Future[None] = Future()
        with self._cond:
            if self._error is not None or self._closing:
                raise EngineDeadError(f"engine is not running: {self._error or 'shut down'}")
            backend_ids = {c.backend_id for c in request.choices}
            if request.request_id in self._requests or not backend_ids.isdisjoint(self._backend_ids):
                raise ConfigError("request_id", f"{request.request_id!r} is already in use")
            self._requests[request.request_id] = request
            self._backend_ids |= backend_ids
            self._commands.append(AddCommand(request, accepted))
            self._cond.notify()
        return accepted

    def abort(self, request_id: str) -> None:
        with self._cond:
            request = self._requests.get(request_id)
            if request is not None:
                self._commands.append(AbortCommand(request))
                self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()

    def stats(self) -> BackendStats:
        """The engine's counters as of its latest step, with ``num_waiting`` counting what waits for a slot.

        The engine counts its own queue only after a step; requests handed to it since then count as waiting
        for whatever they add beyond ``max_num_seqs`` slots, so that a burst is counted as it arrives."""
        stats = self.stats_snapshot
        with self._cond:
            queued = sum(len(c.request.choices) for c in self._commands if isinstance(c, AddCommand))
        waiting = max(stats.num_waiting, stats.num_running + stats.num_waiting + queued - self._max_num_seqs)
        return msgspec.structs.replace(stats, num_waiting=waiting)

    @property
    def error(self) -> BaseException | None:
        """What killed the loop, if it died."""
        return self._error

    # -- the engine thread -----------------------------------------------------

    def run(self, engine: Engine) -> None:
        """Step ``engine`` until closed or broken; shuts it down either way."""
        self.engine = engine
        try:
            while True:
                commands, closing = self._next_commands()
                for command in commands:
                    self._apply(command)
                if closing:
                    self._cancel_all()
                    break
                if engine.has_unfinished():
                    deltas = engine.step()
                    self.stats_snapshot = engine.stats()  # fresh before callers see this step's events
                    self._drop(self.outputs.process(deltas))
                self.stats_snapshot = engine.stats()
        except BaseException as e:  # the backend failed: every caller must hear about it
            log.exception("engine loop died")
            self._die(e)
        finally:
            engine.shutdown()

    def _next_commands(self) -> tuple[list[Command], bool]:
        with self._cond:
            while not (self._commands or self._closing or self.engine.has_unfinished()):
                self._cond.wait()
            commands, self._commands = self._commands, []
            return commands, self._closing

    def _apply(self, command: Command) -> None:
        if isinstance(command, AddCommand):
            self._add(command.request, command.accepted)
        else:
            self._abort(command.request)

    def _drop(self, backend_ids: list[str]) -> None:
        if backend_ids:
            self.engine.abort(backend_ids)

    def _add(self, request: RequestState, accepted: Future[None]) -> None:
        added: list[str] = []
        try:
            for choice in request.choices:
                self._add_choice(request, choice)
                added.append(choice.backend_id)
                self.outputs.choices[choice.backend_id] = (request, choice)
        except Exception as e:
            self.engine.abort(added)
            for backend_id in added:
                del self.outputs.choices[backend_id]
            self._forget(request)
            settle(accepted, e)
            return
        settle(accepted, None)

    def _add_choice(self, request: RequestState, choice: ChoiceState) -> None:
        if request.pooling is not None:
            if not isinstance(self.engine, EmbeddingEngine):
                raise UnsupportedOptionError("embeddings", self.backend_name, "it declares pooling_types "
                                             "without contract 2.4's add_embedding_request")
            self.engine.add_embedding_request(choice.backend_id, request.prompt_ids, request.pooling)
            return
        seed = request.params.seed  # the core fans out n choices with seeds seed + index
        # Every engine request generates at least one token (the core drops it from a request that only scores its
        # prompt: see OutputProcessor). Each choice scores the prompt it asks for: the events of each then carry it.
        params = msgspec.structs.replace(request.params, n=1, max_tokens=max(1, request.params.max_tokens or 0),
                                         seed=None if seed is None else _wrap_int64(seed + choice.index))
        if choice.constraint is None:
            self.engine.add_request(choice.backend_id, request.prompt_ids, params)
        else:
            self.engine.add_request(choice.backend_id, request.prompt_ids, params, constraint=choice.constraint)

    def _abort(self, request: RequestState) -> None:
        if self._requests.get(request.request_id) is request:  # else it already finished
            self._drop(self.outputs.cancel(request))

    def _cancel_all(self) -> None:
        for request in list(self._requests.values()):
            self._abort(request)

    def _forget(self, request: RequestState) -> None:
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
        for command in commands:
            if isinstance(command, AddCommand):
                settle(command.accepted, dead)
        for request in requests:
            try:
                request.sink(dead)
            except Exception:
                log.warning("could not tell request %s that the engine died", request.request_id)


def settle(future: Future[None], error: BaseException | None) -> None:
    """Resolve a caller's future unless the caller already cancelled it (it has gone away: nothing to tell)."""
    if future.set_running_or_notify_cancel():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _wrap_int64(value: int) -> int:
    """Keep per-choice seeds (``seed + index``) inside the signed 64-bit range seeds are validated to."""
    return (value + 2**63) % 2**64 - 2**63
