"""The contract between the core and a backend (version 3).

A backend plugin object (registered through the ``pocketllm_register_backends``
hook) describes itself with data and creates engines. The engine it creates is
called directly by the core's engine loop once per step: no pluggy there.

What the core does before a backend sees anything
-------------------------------------------------
* ``create_engine`` is called only after every :class:`EngineArgs` field was
  checked against :class:`Capabilities` (architecture, storage types of the
  checkpoint's tensors, device, dtype, KV-cache dtype, tensor parallelism,
  speculative decoding, ``max_num_seqs``, ``backend_options``: see
  :mod:`pocketllm.backend_options`), and after
  every tensor's shape was checked against the model config, and (for the
  architectures the core has rules for) every tensor the model needs found. A
  refusal is an :class:`~pocketllm.errors.UnsupportedOptionError` naming the
  option and the backend.
* Right after ``create_engine``, the core runs one warm-up request through the
  engine (id ``pocketllm-warm-up``: one token, greedy, seeded, ``max_tokens=1``,
  ``logprobs=0`` where the backend has logprobs, else an embedding where it has
  pooling) and refuses the model if what comes out is NaN or infinite.
* ``args.max_model_len`` arrives resolved: an int no larger than the model's
  ``max_position_embeddings`` (by default that limit, capped at
  :data:`pocketllm.limits.MAX_MODEL_LEN_CAP`).
* ``create_engine`` runs on the engine thread: the thread that afterwards makes
  every call to the engine. Thread-affine state (CUDA streams, OpenMP pools)
  may be created there.

Semantics a backend implements
------------------------------
* **Probe scores.** ``probe()`` returns 0 when the backend cannot run here;
  otherwise 1-9 for a reference or test backend that should never win
  ``backend="auto"`` over a real one, 10-19 for a general CPU engine, 20-29 for
  an engine on an accelerator it has to itself. ``auto`` takes the highest
  score; a tie goes to the backend whose name sorts first. A probe that cannot
  run here may raise instead of returning 0: its message is the reason
  ``pocketllm backends`` shows. Every backend is probed on each ``auto`` start,
  so a probe answers from cheap facts (``importlib.util.find_spec``, files,
  device nodes) and never imports a heavy runtime: only the chosen backend's
  ``create_engine`` does.
* **Stop tokens.** A request ends with ``finish_reason="stop"`` when it samples
  an EOS id of the model (unless ``ignore_eos``) or one of
  ``params.stop_token_ids``. The token is part of ``new_token_ids``.
  ``stop_token_id`` is that id whenever it is in ``params.stop_token_ids``,
  also when it is an EOS id too; it is None when the request ended on EOS alone.
* **min_tokens.** Until a request has ``min_tokens`` output tokens, EOS and its
  stop token ids must not be sampled (their logits are masked, as in vLLM);
  an engine that cannot mask them must not list ``"min_tokens"`` in
  ``Capabilities.sampling_options``. The core likewise ignores stop strings
  until then.
* **Seeds.** ``params.seed`` is any signed 64-bit integer, negative ones
  included; equal seeds give equal tokens for the same request, and different
  seeds independent draws. Where the engine's arithmetic does not depend on the
  batch (the configuration a backend runs the conformance kit in), equal seeds
  give equal tokens whatever else is in the batch. The core fans out ``n`` choices with
  seeds ``seed + index`` (wrapped to int64). Without a seed a request draws from
  a stream the engine seeds from ``EngineArgs.seed``.
* **Length.** ``params.max_tokens`` arrives resolved: prompt plus max_tokens
  never exceeds ``max_model_len``. Reaching it ends the request with
  ``finish_reason="length"``.

Steps of several tokens (contract 3)
------------------------------------
A step may give a request any number of new tokens: none (a prompt still
prefilling), one, or several (speculative decoding). ``new_token_ids`` lists
them in order and ``logprobs``, where asked for, has one entry per token. The
engine stops at EOS, a stop token and ``max_tokens`` inside the step as it
would one token at a time: nothing comes after the token that ended the
request. Where a request has a constraint, the engine calls
``constraint.accept`` for each token in turn, masking each one's choice with
the mask after the tokens before it. The core takes the tokens in order too: a
stop string found among them ends the request at that token, the tokens after
it are dropped (never streamed), and the core aborts the request if the engine
had not finished it.

Prompt logprobs (contract 3.1)
------------------------------
A backend that lists ``"prompt_logprobs"`` in ``Capabilities.sampling_options`` scores the prompt of a request
with ``params.prompt_logprobs`` set: for each prompt token after the first, the log-softmax of the raw model
logits (no temperature, penalty, bias or grammar) at the position before it, as a :class:`SampledLogprobs` of
that token with ``params.prompt_logprobs`` top alternatives. They come together, in prompt order, on the
request's first delta with a token (P-1 entries for a P-token prompt), however the prompt was chunked. A cached
prefix has no logits: such a request does not reuse the prefix cache (it may still fill it). The core sends
``max_tokens`` of at least 1; a request that only scores its prompt (``max_tokens=0``) has its one token dropped
by the core.

Speculative decoding (contract 3)
---------------------------------
A backend lists the methods it runs in ``Capabilities.speculative_methods``
(from :data:`pocketllm.args.SPECULATIVE_METHODS`); the core refuses any other.
``EngineArgs`` carries the settings, checked before the backend sees them:

* ``speculative_method``: ``ngram`` (drafts copied from the sequence itself: the
  continuation of the latest earlier occurrence of its last ``ngram_max`` ..
  ``ngram_min`` tokens, longest first), ``mtp`` (the checkpoint's own
  multi-token-prediction layers) or ``draft_model`` (a smaller model at
  ``EngineArgs.draft_model`` with the target's vocabulary);
* ``num_speculative_tokens``: at most this many tokens drafted per sequence and
  step, 1..:data:`pocketllm.limits.MAX_SPECULATIVE_TOKENS`;
* ``ngram_min`` / ``ngram_max`` (filled in for ``ngram``, refused otherwise),
  ``draft_model`` (required for ``draft_model``, refused otherwise).

What a backend that drafts promises:

* **Exact.** Greedy requests give exactly the tokens they give without
  speculative decoding. Sampled requests follow the same output distribution:
  drafts are verified against the target model's probabilities after every
  logits processor (penalties, bias, top-k/p, min-p, grammar mask), by
  rejection sampling with a residual draw at a rejected position, or by
  keeping a draft where the target's own seeded draw is it (the builtin
  backends: model drafts are drawn with that same noise), so a draft changes
  how fast tokens come, never which.
* **Reproducible.** A request's seed gives the same tokens with and without
  other requests in the batch, and its draws do not depend on how many drafted
  tokens were accepted before.
* **Target logprobs.** ``logprobs`` are the target model's, for each token.
* **Stats.** ``BackendStats`` counts ``num_spec_drafts`` (a sequence drafting
  in a step), ``num_spec_draft_tokens``, ``num_spec_accepted_tokens`` and
  ``spec_accepted_per_position`` (index i: drafts whose token i was accepted),
  cumulatively; the server exports them under ``/metrics``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from pocketllm.backend_options import BackendOptions
from pocketllm.limits import MAX_LOGPROBS, MAX_N

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from pocketllm.args import EngineArgs
    from pocketllm.checkpoint import Checkpoint
    from pocketllm.pooling import PoolingParams
    from pocketllm.sampling_params import SamplingParams
    from pocketllm.structured import Constraint

# 2.1: BackendStats snapshot counters; 2.2: TensorParallelBackend; 2.3: structured outputs; 2.4: EmbeddingEngine;
# 3.0: steps of several tokens, the speculative-decoding contract, typed backend options, Capabilities.storage_types;
# 3.1: prompt logprobs
API_VERSION = (3, 1)
"""``(major, minor)`` of this contract. A backend built for the same major and an older or equal minor loads;
the minor grows with additions a backend may ignore, the major with changes it may not."""

SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "logit_bias", "seed", "min_tokens", "logprobs", "prompt_logprobs")
"""SamplingParams fields a backend may leave unimplemented, by name. Greedy decoding, ``max_tokens``, EOS,
``ignore_eos`` and ``stop_token_ids`` are part of every engine; ``n`` and stop strings are the core's."""

FLOAT_STORAGE_TYPES = ("F32", "F16", "BF16")


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend can do, as data the core checks before creating an engine or adding a request.

    Whatever is not declared here is refused by the core with UnsupportedOptionError, so an engine never
    sees a request it would have to ignore part of.
    """

    architectures: tuple[str, ...] = ()
    """``ModelConfig.architecture`` values this backend runs (the only architecture gate)."""
    storage_types: tuple[str, ...] = FLOAT_STORAGE_TYPES
    """Tensor storage types it can load (``CheckpointTensor.storage_type``: "F32", "Q4_K", ...)."""
    sampling_options: tuple[str, ...] = ()
    """Names from :data:`SAMPLING_OPTIONS` it implements with the contract's semantics."""
    max_logprobs: int = MAX_LOGPROBS
    max_n: int = MAX_N
    """Most choices per request (the core fans them out as separate engine requests)."""
    max_num_seqs: int | None = None
    """Largest batch (``EngineArgs.max_num_seqs``) it can run; None: no limit of its own."""
    prefix_caching: bool = False
    structured_outputs: bool = False
    """Masks each token of a request to its :class:`~pocketllm.structured.Constraint` (see ``add_request``)."""
    pooling_types: tuple[str, ...] = ()
    """:data:`pocketllm.pooling.POOLING_TYPES` its engine pools embeddings with (see :class:`EmbeddingEngine`);
    empty: no embeddings."""
    tensor_parallel: bool = False
    speculative_methods: tuple[str, ...] = ()
    devices: tuple[str, ...] = ("cpu",)
    dtypes: tuple[str, ...] = ("float32",)
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    backend_options: type[BackendOptions] = BackendOptions
    """The backend's options: a :class:`~pocketllm.backend_options.BackendOptions` subclass, one typed field
    (range, help text, default) per key accepted in ``EngineArgs.backend_options``. The core converts the
    user's dict into it, refusing unknown keys and bad values, and hands the instance to ``create_engine``."""

    @property
    def logprobs(self) -> bool:
        return "logprobs" in self.sampling_options

    @property
    def quantization_formats(self) -> tuple[str, ...]:
        """The quantized storage types among ``storage_types`` (GGUF block types such as "Q4_K"): what it runs
        besides float weights."""
        return tuple(t for t in self.storage_types if t not in FLOAT_STORAGE_TYPES and t != "F64")


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
    """What one step produced for one request: ``new_token_ids`` holds 0..k tokens in the order they were
    produced, with one ``logprobs`` entry each (see "Steps of several tokens" above).

    ``finish_reason`` is ``"stop"`` (EOS or a stop token; see the module docstring for ``stop_token_id``),
    ``"length"`` (max_tokens reached), ``"error"`` (this request failed in the step: ``error`` says why, and
    the other requests of the step carry on) or ``None`` while the request runs. A finished request's KV is
    already freed, and the engine never mentions it again. An embedding request's one delta has ``embedding``
    set, no tokens and ``finish_reason="stop"``.
    """

    request_id: str
    new_token_ids: list[int]
    logprobs: list[SampledLogprobs] | None = None
    prompt_logprobs: list[SampledLogprobs] | None = None
    """With ``params.prompt_logprobs`` (contract 3.1), on the request's first delta with a token: prompt tokens
    1 .. P-1 each given the tokens before it (see "Prompt logprobs" above)."""
    finish_reason: str | None = None
    stop_token_id: int | None = None
    error: str | None = None
    embedding: list[float] | None = None


class BackendStats(msgspec.Struct, kw_only=True):
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks_total: int = 0
    num_kv_blocks_used: int = 0
    num_preemptions: int = 0
    num_prefix_cache_queries: int = 0
    num_prefix_cache_hits: int = 0
    # Hybrid models (state layers beside attention): prefix-cache snapshots of their states held now, requests
    # resumed from one, and snapshots evicted.
    num_state_snapshots: int = 0
    num_state_snapshot_hits: int = 0
    num_state_snapshot_evictions: int = 0
    # Speculative decoding (see "Speculative decoding" above), cumulative: drafts proposed (one per sequence and
    # step that drafted), tokens in them, draft tokens accepted, and acceptances by position in the draft.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = msgspec.field(default_factory=list)

    @property
    def kv_usage(self) -> float:
        return self.num_kv_blocks_used / self.num_kv_blocks_total if self.num_kv_blocks_total else 0.0


@runtime_checkable
class Engine(Protocol):
    """A running backend engine: request-level, called from the engine thread only.

    The engine owns scheduling, the KV cache (its layout is private) and
    sampling, and applies ``max_tokens``, ``min_tokens``, EOS, ``ignore_eos``
    and ``stop_token_ids`` itself. Stop strings and ``n`` are the core's job:
    it calls :meth:`abort` when a stop string matches.
    """

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    constraint: Constraint | None = None) -> None:
        """Queue a request. The engine may assume, without checking again, that:

        * ``request_id`` is not in use by a request this engine still knows;
        * ``prompt_token_ids`` is non-empty and every id is in ``[0, vocab_size)``;
        * ``len(prompt_token_ids) + params.max_tokens <= max_model_len`` (``max_tokens`` is an int);
        * ``params.n == 1``; ``logit_bias`` and ``stop_token_ids`` ids are in ``[0, vocab_size)``;
        * every sampling option in use is listed in ``Capabilities.sampling_options``, and
          ``params.logprobs`` is at most ``Capabilities.max_logprobs``.

        ``constraint`` comes only with ``params.structured_outputs``, and only to a backend that declares
        ``Capabilities.structured_outputs``: before choosing each token, allow only the tokens
        ``constraint.fill_bitmask`` sets, after every other logits processor; then ``constraint.accept`` the
        token. A failure of either fails this request alone (``finish_reason="error"``).

        Raise a :class:`~pocketllm.errors.PocketLLMError` subclass for anything else it cannot take (say,
        :class:`~pocketllm.errors.PromptTooLongError` when its KV pool could never hold the prompt); nothing
        is queued then, and the error reaches the caller.
        """

    def step(self) -> list[RequestDelta]:
        """Run one scheduling step and return a delta for each request that advanced or finished.

        What one request's parameters make fail (in its sampling, say) must fail that request alone, with a
        ``finish_reason="error"`` delta. An exception out of ``step`` means the engine itself is broken: the
        core then ends every request with EngineDeadError and stops the engine."""

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop requests, waiting or running (unknown ids are ignored), and free their KV blocks before
        returning. An aborted request gets no further delta."""

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""

    def stats(self) -> BackendStats:
        """Counters and gauges for metrics and tests; all zero but the totals once every request is done."""

    def shutdown(self) -> None:
        """Release every resource; the engine is not used afterwards."""


@runtime_checkable
class EmbeddingEngine(Engine, Protocol):
    """The engine of a backend that declares ``Capabilities.pooling_types`` also implements this (contract 2.4)."""

    def add_embedding_request(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams) -> None:
        """Queue a request for the embedding of a prompt, batched with whatever else runs.

        The core has checked the prompt as for ``add_request`` (with ``len(prompt_token_ids) <= max_model_len``)
        and resolved ``params.pooling_type`` to one of ``Capabilities.pooling_types``; ``params.dimensions`` is
        None or the model's hidden size. Run the prompt (prefix-cached blocks may be reused where the pooling
        does not need their states) and pool the final hidden states, after the model's last norm: the last
        prompt token's (``last``), the first's (``cls``) or their mean (``mean``), in float32, L2-normalized if
        ``params.normalize``. Report it in one delta with ``embedding`` set and ``finish_reason="stop"``; the
        request then holds nothing. ``abort`` and ``stats`` count it as any request."""


@runtime_checkable
class BackendPlugin(Protocol):
    """What a backend distribution registers through ``pocketllm_register_backends``."""

    name: str
    api_version: tuple[int, int]

    def probe(self) -> int:
        """Return a score for this machine (see "Probe scores" above): 0 means unavailable."""

    def capabilities(self) -> Capabilities:
        """Describe this backend; must be cheap and must not load a model."""

    def create_engine(self, args: EngineArgs, checkpoint: Checkpoint, options: BackendOptions) -> Engine:
        """Build an engine for ``checkpoint`` on the engine thread, reading its tensors (see
        :class:`~pocketllm.checkpoint.CheckpointTensor`) in whatever form suits the backend.

        ``options`` is ``args.backend_options`` converted into this backend's ``Capabilities.backend_options``
        class: every key known, every value of its declared type and in its range, the defaults filled in.
        Checks that need the model (a KV pool that holds no sequence, say: see :mod:`pocketllm.kv_budget`) are
        the backend's, raising :class:`~pocketllm.errors.ConfigError` on ``backend_options``.

        With ``args.tensor_parallel_size`` > 1 this runs on rank 0 (see :mod:`pocketllm.tensor_parallel`): the
        engine joins the other ranks (their place is in torchrun's environment variables) and schedules."""


@runtime_checkable
class TensorParallelBackend(BackendPlugin, Protocol):
    """A backend that declares ``Capabilities.tensor_parallel`` also implements this (contract 2.2)."""

    def run_tp_worker(self, args: EngineArgs, checkpoint: Checkpoint, options: BackendOptions,
                      ready: Callable[[], None]) -> None:
        """Serve as a rank other than 0 of a ``args.tensor_parallel_size``-rank engine, until rank 0 shuts down.

        Called in that rank's own process, on its main thread, with the same ``args``, checkpoint and ``options``
        (resolved as for ``create_engine``) as rank 0 (the rank and the rendezvous are in torchrun's environment
        variables: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). Join rank 0's
        group, load this rank's share of the weights, call ``ready()`` once, then run whatever rank 0's engine asks
        of this rank each step (its worker protocol is the backend's own) and return when rank 0's engine shuts
        down. Raise if rank 0 goes away or the rank cannot load: the process then exits non-zero, which a
        supervisor reports with the rank."""
