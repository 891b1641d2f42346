"""Test hooks: what tests of the core reach that applications have no need of."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pocketllm.client import EngineClient
    from pocketllm.driver import EngineDriver


def engine_driver(client: EngineClient) -> EngineDriver:
    """The EngineDriver behind an ``LLM`` or ``AsyncLLM``, for tests of the driver itself: requests added with a
    sink of the test's own (``add_request(prompt_ids, params, sink, request_id)``, whose sink may block the engine
    thread on purpose), the deltas an engine sent for finished requests (``num_stray_deltas``), the grammar
    compiler (``grammars``). Not an application API: the driver changes as the core does."""
    return client._driver
