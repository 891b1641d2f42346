"""Hook specifications: the whole pluggy surface of PocketLLM.

Backends are found through the ``pocketllm.backends`` entry-point group; the
object an entry point names (usually a module) carries ``@hookimpl`` functions.
Per-step work never goes through pluggy: see :class:`pocketllm.backend.Engine`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from pocketllm.args import EngineArgs
    from pocketllm.backend import BackendPlugin

hookspec = pluggy.HookspecMarker("pocketllm")
hookimpl = pluggy.HookimplMarker("pocketllm")


@hookspec
def pocketllm_register_backends(register: Callable[[BackendPlugin], None]) -> None:
    """Register backend objects by calling ``register(backend)`` once per backend.

    Called once per plugin manager. Must be cheap: do not import heavy
    libraries or touch devices here; do that in ``probe`` or ``create_engine``.
    """


@hookspec(firstresult=True)
def pocketllm_select_backend(args: EngineArgs, scores: dict[str, int]) -> str | None:
    """Return the name of the backend to use, or None to defer.

    Only consulted when ``args.backend == "auto"``. The first non-None answer
    wins; with none, the backend with the highest score above 0 is used.
    """


@hookspec
def pocketllm_engine_started(args: EngineArgs, backend_name: str) -> None:
    """Observe that an engine was created (logging, metrics). Exceptions propagate."""


@hookspec
def pocketllm_request_finished(request_id: str, finish_reason: str, num_prompt_tokens: int,
                               num_completion_tokens: int) -> None:
    """Observe a finished request, once per engine request, off the step path.

    Called on the engine thread after the last token was delivered; keep it fast.
    An observer that raises is logged, listed by ``pocketllm backends`` as broken and not called again; the
    request and the engine go on.
    """
