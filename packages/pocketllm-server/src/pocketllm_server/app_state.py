"""What the app holds across requests (ServerState): its settings, the engine (loaded in the background), admission
control and metrics; and the prologue of every route that runs the model."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol, TypeVar

from starlette.requests import Request

from pocketllm import AsyncLLM, BackendStats, EngineArgs, SamplingParams
from pocketllm.structured import GrammarCacheStats
from pocketllm_server.engine_stream import EngineStream
from pocketllm_server.errors import APIError, unavailable
from pocketllm_server.metrics import ServerMetrics
from pocketllm_server.protocol import decode
from pocketllm_server.response_store import ResponseStore

log = logging.getLogger("pocketllm_server")
_DECODE_INLINE_BYTES = 64 * 1024


def load_engine(engine_args: EngineArgs) -> AsyncLLM:
    """Build the engine (blocking: loads weights). A module function so tests can slow it down."""
    return AsyncLLM(engine_args=engine_args, show_progress=False)  # its stages go to the server's log


def state_of(request: Request) -> ServerState:
    state: ServerState = request.app.state.server  # set by create_app
    return state


class _NamesModel(Protocol):
    model: str | None


ModelRequest = TypeVar("ModelRequest", bound=_NamesModel)


async def read_model_request(request: Request, kind: type[ModelRequest]) -> tuple[ServerState, ModelRequest, AsyncLLM]:
    """The prologue of every route that runs the model: check the content type (415), decode the body as
    ``kind`` (400), check that it names the served model (404) and require a running engine (503)."""
    state = state_of(request)
    media_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, got {media_type!r}", param="content-type",
                       code="unsupported_media_type")
    raw = await request.body()
    # A large body takes a while to scan and decode: off the event loop, so /health and streams keep going.
    body = decode(raw, kind) if len(raw) < _DECODE_INLINE_BYTES else await asyncio.to_thread(decode, raw, kind)
    state.check_model(body.model)
    return state, body, state.require_llm()


class ServerState:
    def __init__(self, engine_args: EngineArgs, *, served_model_name: str, max_queue_len: int | None,
                 llm: AsyncLLM | None, generation_config: str = "auto",
                 responses: ResponseStore | None = None) -> None:
        self.engine_args = engine_args
        self.generation_config = generation_config
        self.served_model_name = served_model_name
        self.reasoning_parser: str | None = None  # --reasoning-parser: <think> sections split from answers
        self.tool_call_parser: str | None = None  # --tool-call-parser: tool calls parsed out of replies
        self.pooling_type: str | None = None  # --pooling-type: embeddings' pooling, else the checkpoint's
        self.max_queue_len = max_queue_len
        self.responses = ResponseStore() if responses is None else responses  # the Responses API's stored ones
        self.llm = llm
        self.owns_llm = llm is None  # an engine handed in by the caller is theirs to shut down
        self.load_error: BaseException | None = None
        self.draining = False
        self.created = int(time.time())
        self.metrics = ServerMetrics(served_model_name, self.stats, self.grammar_cache_stats)
        self._load_task: asyncio.Task[None] | None = None
        self._load_done: asyncio.Event | None = None

    # -- lifecycle -----------------------------------------------------------------------------------------------

    async def startup(self) -> None:
        self._load_done = asyncio.Event()
        if self.llm is None:
            # In the background, so /alive and /ready answer (and say "not yet") while weights load.
            self._load_task = asyncio.create_task(self._load())
        else:
            self._load_done.set()

    async def _load(self) -> None:
        assert self._load_done is not None
        args = self.engine_args
        log.info("loading model %s (backend %s)", args.model, args.backend)
        started = time.monotonic()
        try:
            llm = await asyncio.to_thread(load_engine, args)
        except Exception as e:
            self.load_error = e
            log.error("could not load model %s: %s: %s", args.model, type(e).__name__, e)
        else:
            self.llm = llm
            log.info("model %s ready on backend %s in %.1f s (max_model_len %s); serving as %r", args.model,
                     llm.backend_name, time.monotonic() - started, llm.args.max_model_len, self.served_model_name)
            if self.sampling_defaults:
                log.info("sampling fields a request leaves out default to the model's recommendation: %s "
                         "(--generation-config none turns this off)", self.sampling_defaults)
        finally:
            self._load_done.set()

    async def wait_loaded(self) -> None:
        """Return once loading ended, whether it worked or not."""
        assert self._load_done is not None, "startup() was not called"
        await self._load_done.wait()

    async def shutdown(self) -> None:
        """Refuse new requests, then stop the engine we own: that ends every in-flight request with ``abort``."""
        self.draining = True
        if self._load_task is not None:
            await self._load_task  # a load cannot be interrupted; its engine must still be shut down
        if self.owns_llm and self.llm is not None:
            await asyncio.to_thread(self.llm.shutdown)

    # -- queries -------------------------------------------------------------------------------------------------

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """What a request that leaves a sampling field out gets: the model's recommendation, or the API's own
        defaults with ``--generation-config none``."""
        if self.generation_config == "none" or self.llm is None:
            return {}
        return self.llm.sampling_defaults

    @property
    def ready(self) -> bool:
        return self.llm is not None and self.llm.is_alive and not self.draining

    def stats(self) -> BackendStats | None:
        return self.llm.stats() if self.llm is not None else None

    def grammar_cache_stats(self) -> GrammarCacheStats | None:
        return self.llm.grammar_cache_stats() if self.llm is not None else None

    def check_model(self, model: str | None) -> None:
        # Ollama's clients name a model with its tag; ":latest" is what an untagged name means to them.
        if model is not None and model not in (self.served_model_name, f"{self.served_model_name}:latest"):
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.served_model_name}`.",
                           param="model", code="model_not_found")

    def require_llm(self) -> AsyncLLM:
        if self.draining:
            raise unavailable("the server is shutting down", "shutting_down")
        if self.load_error is not None:
            raise unavailable(f"the model failed to load: {self.load_error}", "model_load_failed")
        if self.llm is None:
            raise unavailable("the model is still loading", "model_loading")
        if not self.llm.is_alive:
            raise unavailable("the engine has stopped", "engine_dead")
        return self.llm

    # -- requests ------------------------------------------------------------------------------------------------

    def check_queue(self, count: int, param: str) -> AsyncLLM:
        """The engine, if it takes ``count`` more sequences (one request's prompts or inputs, times ``n``).

        With ``max_queue_len``: 503 when more than that many sequences would then wait for a slot (running ones do
        not count: new ones take free slots first, unless some already wait), and a 400 naming ``param`` for a
        request that alone would leave more than that waiting on an idle engine, as no retry would help it.
        """
        llm = self.require_llm()
        if self.max_queue_len is None:
            return llm
        slots = llm.args.max_num_seqs
        if count > slots + self.max_queue_len:
            raise APIError(400, f"this request needs {count} sequences (its prompts or inputs, times n); this server "
                                f"runs {slots} at once (max_num_seqs) and lets {self.max_queue_len} wait "
                                "(max_queue_len)", param=param, code="too_many_sequences")
        stats = llm.stats()
        free = 0 if stats.num_waiting else max(0, slots - stats.num_running)
        if stats.num_waiting + max(0, count - free) > self.max_queue_len:
            raise unavailable(f"too many requests waiting (max_queue_len={self.max_queue_len}); retry later",
                              "queue_full")
        return llm

    async def start(self, llm: AsyncLLM, prompt_ids: list[int], params: SamplingParams,
                    request_id: str) -> EngineStream:
        """Start a request that ``check_queue`` admitted, and wait for its first output, so that every error it can
        have (the engine's, for a bad request) is raised here."""
        stream = EngineStream(self.metrics, llm.stream_ids(prompt_ids, params, request_id=request_id),
                              len(prompt_ids))
        await stream.pull_first()
        return stream
