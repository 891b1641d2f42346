"""A backend wrapper that fails on purpose, so the kit can check how errors travel through any real backend."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pocketllm.backend import BackendStats, RequestDelta
from pocketllm.backend_options import BackendOptions
from pocketllm.errors import UnsupportedOptionError
from pocketllm.sampling_params import SamplingParams
from pocketllm.testing.wrapper import BackendWrapper


class FaultyAddBackend(BackendWrapper):
    """``inner`` under another name, whose engine refuses the second choice (id ending "-1") of any request."""

    OPTION = "conformance_fault"
    suffix = "faulty-add"

    def create_engine(self, args: Any, checkpoint: Any, options: BackendOptions) -> _FaultyAddEngine:
        return _FaultyAddEngine(self.inner.create_engine(args, checkpoint, options), self.name)


class _FaultyAddEngine:
    def __init__(self, inner: Any, name: str) -> None:
        self.inner = inner
        self.name = name

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id.endswith("-1"):
            raise UnsupportedOptionError(FaultyAddBackend.OPTION, self.name, "refused on purpose by the kit")
        self.inner.add_request(request_id, prompt_token_ids, params)

    def step(self) -> list[RequestDelta]:
        return self.inner.step()

    def abort(self, request_ids: Iterable[str]) -> None:
        self.inner.abort(request_ids)

    def has_unfinished(self) -> bool:
        return self.inner.has_unfinished()

    def stats(self) -> BackendStats:
        return self.inner.stats()

    def shutdown(self) -> None:
        self.inner.shutdown()
