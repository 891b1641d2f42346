"""The worker protocol: one JSON object per line each way.

Requests are ``{"op": name, ...arguments}``; replies are ``{"ok": true, "result": {...}}`` or
``{"ok": false, "error": traceback text}``. Ops: ``generate``, ``stream``, ``serve`` (the
``pocketllm-async`` engine only), ``cache_stats`` (PocketLLM's ``LLM`` engine only), ``rss``.
"""

from __future__ import annotations

import json
from typing import IO, Any


def write_message(stream: IO[str], message: dict[str, Any]) -> None:
    stream.write(json.dumps(message, separators=(",", ":")) + "\n")
    stream.flush()


def read_message(stream: IO[str]) -> dict[str, Any] | None:
    """The next message, or None at end of stream."""
    line = stream.readline()
    return json.loads(line) if line else None
