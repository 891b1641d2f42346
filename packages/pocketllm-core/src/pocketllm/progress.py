"""Staged progress of loading an engine, with timings: on a terminal's stderr, and always in the log.

Loading takes seconds (reading the checkpoint, importing the backend, converting weights); a terminal user should
see that something happens and what. Off a terminal (a service, a pipe), or with ``POCKETLLM_QUIET=1`` or
``show_progress=False``, only the log hears of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import TextIO

QUIET_ENV = "POCKETLLM_QUIET"

log = logging.getLogger("pocketllm")


class LoadProgress:
    def __init__(self, show: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        if show is None:
            quiet = os.environ.get(QUIET_ENV, "").lower() in ("1", "true", "yes")
            show = not quiet and _isatty(self.stream)
        self.show = show
        self.started = time.monotonic()

    @contextlib.contextmanager
    def stage(self, what: str) -> Iterator[None]:
        """``with progress.stage("reading model"):`` prints the stage, then how long it took."""
        log.info("%s ...", what)
        self._write(f"pocketllm: {what} ...")
        started = time.monotonic()
        yield
        took = time.monotonic() - started
        log.info("%s: done in %.1f s", what, took)
        self._write(f" {took:.1f} s\n")

    def done(self, what: str) -> None:
        took = time.monotonic() - self.started
        log.info("ready in %.1f s: %s", took, what)
        self._write(f"pocketllm: ready in {took:.1f} s: {what}\n")

    def _write(self, text: str) -> None:
        if self.show:
            self.stream.write(text)
            self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
