"""PocketLLM's OpenAI-compatible HTTP server."""

from __future__ import annotations

from pocketllm_server.app import create_app

__all__ = ["create_app"]
