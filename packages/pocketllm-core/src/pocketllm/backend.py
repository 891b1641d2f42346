"""The contract between the core and a backend.

A backend plugin object (registered through the ``pocketllm_register_backends``
hook) describes itself with data and creates engines. The engine it creates is
called directly by the core's engine loop once per step: no pluggy there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pocketllm.args import EngineArgs
    from pocketllm.checkpoint import Checkpoint
    from pocketllm.sampling_params import SamplingParams

API_VERSION = 1
"""Bumped when this module changes incompatibly. A backend declares the version it was built for."""


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend can do, as data the core checks before creating an engine."""

    batching: bool = True
    logprobs: bool = True
    max_logprobs: int = 20
    prefix_caching: bool = False
    tensor_parallel: bool = False
    speculative_methods: tuple[str, ...] = ()
    quantization_formats: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu",)
    dtypes: tuple[str, ...] = ("float32",)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    backend_options: tuple[str, ...] = ()
    """Keys accepted in ``EngineArgs.backend_options``."""


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    token_id: int
    logprob: float


class SampledLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Log-probability of the sampled token and its top alternatives, from the raw model logits."""

    token_id: int
    logprob: float
    rank: int
    top: list[TokenLogprob]


class RequestDelta(msgspec.Struct, kw_only=True, array_like=True, omit_defaults=True):
    """What one step produced for one request.

    ``finish_reason`` is ``"stop"`` (EOS or a stop token, whose id goes in
    ``stop_token_id``), ``"length"`` (max_tokens or max_model_len reached) or
    ``None`` while the request runs. A finished request's KV is already freed.
    """

    request_id: str
    new_token_ids: list[int]
    logprobs: list[SampledLogprobs] | None = None
    finish_reason: str | None = None
    stop_token_id: int | None = None


class BackendStats(msgspec.Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0
    num_preemptions: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0.0


@runtime_checkable
class Engine(Protocol):
    """A running backend engine: request-level, called from one thread only.

    The engine owns scheduling, the KV cache (its layout is private) and
    sampling, and applies ``max_tokens``, ``min_tokens``, EOS, ``ignore_eos``
    and ``stop_token_ids`` itself. Stop strings are the core's job: it calls
    :meth:`abort` when one matches.
    """

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request. ``params.n`` is always 1 here: the core fans out ``n``.

        Raise :class:`~pocketllm.errors.UnsupportedOptionError` for a parameter
        this engine cannot honour, and :class:`~pocketllm.errors.PromptTooLongError`
        for a prompt that cannot fit; nothing is queued then.
        """

    def step(self) -> list[RequestDelta]:
        """Run one scheduling step and return a delta for each request that advanced or finished."""

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop requests (unknown ids are ignored) and free their KV blocks before returning."""

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""

    def stats(self) -> BackendStats:
        """Counters and gauges for metrics and tests."""

    def shutdown(self) -> None:
        """Release every resource; the engine is not used afterwards."""


@runtime_checkable
class BackendPlugin(Protocol):
    """What a backend distribution registers through ``pocketllm_register_backends``."""

    name: str
    api_version: int

    def probe(self) -> int:
        """Return a score for this machine: 0 means unavailable, higher is preferred by ``backend="auto"``."""

    def capabilities(self) -> Capabilities:
        """Describe this backend; must be cheap and must not load a model."""

    def create_engine(self, args: EngineArgs, checkpoint: Checkpoint) -> Engine:
        """Build an engine for ``checkpoint``. Raise UnsupportedOptionError for what it cannot do."""
