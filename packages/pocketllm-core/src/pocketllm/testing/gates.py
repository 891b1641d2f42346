"""A backend wrapper whose steps a test controls, so that tests wait on engine events instead of sleeping.

::

    registry = BackendRegistry()
    gated = GatedBackend.install(registry, "echo")
    llm = LLM(model, backend=gated.name, registry=registry)
    gated.gate.hold()                  # from now on no step runs unless released
    ...                                # start sixteen requests
    assert gated.gate.wait_added(16)   # every one of them is in the engine
    gated.gate.open()                  # and they run, together: gated.gate.batch_sizes[0] == 16

A held engine keeps reaching its step boundaries, where the driver applies adds, aborts and shutdown: a held step
returns no deltas, as a step that advanced no request does. So a request aborted while held ends without another
token, and a shutdown while held is not stuck behind the gate.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, cast

from pocketllm.backend import BackendPlugin, BackendStats, Engine, RequestDelta
from pocketllm.plugins import BackendRegistry
from pocketllm.sampling_params import SamplingParams
from pocketllm.structured import Constraint
from pocketllm.testing.wrapper import BackendWrapper

if TYPE_CHECKING:
    from pocketllm.args import EngineArgs
    from pocketllm.backend import EmbeddingEngine
    from pocketllm.backend_options import BackendOptions
    from pocketllm.checkpoint import Checkpoint
    from pocketllm.pooling import PoolingParams

IDLE_STEP_S = 0.005
"""How long a held step waits for a release before it returns nothing: the longest a command (an abort, a
shutdown) waits for the driver's next step boundary while the engine is held."""


class StepGate:
    """What each step of a GatedBackend's engine does, set from a test's thread, and what the engine saw.

    Open (as it starts), every step runs. Held, a step runs only where one was released; the others return no
    deltas. Released steps and failures queue in order, held or open: ``release(4)`` then ``fail_next_step(e)``
    runs four steps and raises ``e`` from the fifth, which the core takes for a broken engine.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._script: deque[BaseException | None] = deque()  # the steps to come: None runs one, an error is raised
        self._added: list[str] = []
        self._batch_sizes: list[int] = []

    # -- the test's side -------------------------------------------------------

    def hold(self) -> None:
        """From now on, a step runs only if released (``release``) or scripted to fail (``fail_next_step``)."""
        with self._cond:
            self._held = True

    def release(self, steps: int = 1) -> None:
        """Let ``steps`` more steps run (after whatever was queued before)."""
        with self._cond:
            self._script.extend([None] * steps)
            self._cond.notify_all()

    def fail_next_step(self, error: BaseException) -> None:
        """Raise ``error`` from the next step not already queued, instead of stepping."""
        with self._cond:
            self._script.append(error)
            self._cond.notify_all()

    def open(self) -> None:
        """Stop holding: every step runs (a failure still queued is still raised in its turn)."""
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def reset(self) -> None:
        """Open, with nothing queued and nothing seen: a gate shared by several tests starts each one so."""
        with self._cond:
            self._held = False
            self._script.clear()
            self._added.clear()
            self._batch_sizes.clear()
            self._cond.notify_all()

    def wait_added(self, count: int, timeout: float = 10.0) -> bool:
        """Wait until the engine has been given ``count`` requests in all; False if it had not by ``timeout``."""
        return self._wait(lambda: len(self._added) >= count, timeout)

    def wait_steps(self, count: int, timeout: float = 10.0) -> bool:
        """Wait until ``count`` steps have run in all (held ones that returned nothing do not count)."""
        return self._wait(lambda: len(self._batch_sizes) >= count, timeout)

    @property
    def added(self) -> list[str]:
        """The engine request ids the engine was given, in order (a request with ``n`` choices adds ``n``)."""
        with self._cond:
            return list(self._added)

    @property
    def batch_sizes(self) -> list[int]:
        """For each step that ran, how many requests it advanced."""
        with self._cond:
            return list(self._batch_sizes)

    @property
    def steps(self) -> int:
        """How many steps have run."""
        with self._cond:
            return len(self._batch_sizes)

    def _wait(self, done: Callable[[], bool], timeout: float) -> bool:
        with self._cond:
            return self._cond.wait_for(done, timeout)

    # -- the engine thread's side ----------------------------------------------

    def enter_step(self) -> bool:
        """Whether this step may run; raises a scripted failure; waits up to IDLE_STEP_S for a release if held."""
        with self._cond:
            self._cond.wait_for(lambda: self._script or not self._held, IDLE_STEP_S)
            if self._script:
                error = self._script.popleft()
                if error is not None:
                    raise error
                return True
            return not self._held

    def step_ran(self, deltas: list[RequestDelta]) -> None:
        with self._cond:
            self._batch_sizes.append(len({d.request_id for d in deltas}))
            self._cond.notify_all()

    def request_added(self, request_id: str) -> None:
        with self._cond:
            self._added.append(request_id)
            self._cond.notify_all()


class GatedBackend(BackendWrapper):
    """``inner`` under another name, whose engines step as ``gate`` says."""

    suffix = "gated"

    def __init__(self, inner: BackendPlugin) -> None:
        super().__init__(inner)
        self.gate = StepGate()

    @classmethod
    def install(cls, registry: BackendRegistry, backend: str) -> GatedBackend:
        """Wrap ``registry``'s backend named ``backend`` and register the wrapper there, as ``<backend>-gated``."""
        gated = cls(registry.get(backend))
        registry.register_plugin(gated.as_plugin(), name=gated.name)
        return gated

    def create_engine(self, args: EngineArgs, checkpoint: Checkpoint, options: BackendOptions) -> GatedEngine:
        return GatedEngine(self.inner.create_engine(args, checkpoint, options), self.gate)


class GatedEngine:
    """An engine whose ``step`` asks its gate first; everything else is the inner engine's."""

    def __init__(self, inner: Engine, gate: StepGate) -> None:
        self.inner = inner
        self.gate = gate

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    constraint: Constraint | None = None) -> None:
        # Passed on only when given: a backend without structured outputs may not take the keyword at all.
        if constraint is None:
            self.inner.add_request(request_id, prompt_token_ids, params)
        else:
            self.inner.add_request(request_id, prompt_token_ids, params, constraint=constraint)
        self.gate.request_added(request_id)

    def add_embedding_request(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams) -> None:
        # Reached only where the inner backend declares pooling types (the core refuses embeddings elsewhere), whose
        # engines then have this method (contract 2.4).
        cast("EmbeddingEngine", self.inner).add_embedding_request(request_id, prompt_token_ids, params)
        self.gate.request_added(request_id)

    def step(self) -> list[RequestDelta]:
        if not self.gate.enter_step():
            return []
        deltas = self.inner.step()
        self.gate.step_ran(deltas)
        return deltas

    def abort(self, request_ids: Iterable[str]) -> None:
        self.inner.abort(request_ids)

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()

    def stats(self) -> BackendStats:
        return self.inner.stats()

    def shutdown(self) -> None:
        self.inner.shutdown()
