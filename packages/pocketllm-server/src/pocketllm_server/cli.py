"""The ``pocketllm-server`` command: serve one model over an OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import sys
from collections.abc import Sequence

from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.applications import Starlette

from pocketllm.args import DEFAULT_MODEL
from pocketllm.cli_args import add_engine_args, engine_args_from
from pocketllm.errors import PocketLLMError
from pocketllm.plugins import BackendRegistry
from pocketllm.pooling import POOLING_TYPES
from pocketllm.reasoning import REASONING_PARSERS
from pocketllm.supervisor import supervise
from pocketllm.tensor_parallel import check_world, mark_ready, rank_info, run_worker, watch_parent
from pocketllm_server.app import DEFAULT_MAX_REQUEST_BYTES, GENERATION_CONFIG_CHOICES, create_app
from pocketllm_server.app_state import ServerState
from pocketllm_server.response_store import DEFAULT_MAX_STORED_RESPONSE_BYTES, DEFAULT_MAX_STORED_RESPONSES
from pocketllm_server.tool_calls import TOOL_CALL_PARSERS

log = logging.getLogger("pocketllm_server")
ENGINE_WATCH_INTERVAL_S = 0.5


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {number}")
    return number


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {number}")
    return number


def build_parser(prog: str = "pocketllm-server") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Serve one model over an OpenAI-compatible HTTP API.",
        epilog=f"--model defaults to {DEFAULT_MODEL}; --backend auto picks the best installed backend.")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    server.add_argument("--api-key", default=os.environ.get("POCKETLLM_API_KEY"),
                        help="require 'Authorization: Bearer <key>' (or Anthropic's 'x-api-key: <key>') on /v1/*, "
                             "Ollama's /api/*, /tokenize and /detokenize (default: $POCKETLLM_API_KEY, else no key)")
    server.add_argument("--served-model-name", default=None,
                        help="model name clients use (default: the last part of --model)")
    server.add_argument("--max-queue-len", type=_positive_int, default=None,
                        help="answer 503 with Retry-After while this many sequences (each prompt of a request, "
                             "times n) wait for an engine slot; running ones do not count, and a request that alone "
                             "needs more than --max-num-seqs plus this is a 400 (default: no limit)")
    server.add_argument("--max-request-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="answer 413 to a request body larger than this (default: %(default)s)")
    server.add_argument("--generation-config", choices=GENERATION_CONFIG_CHOICES, default="auto",
                        help="auto: sampling fields a request leaves out take the model's recommended settings "
                             "(generation_config.json, or GGUF general.sampling.*), as vLLM does; none: the "
                             "OpenAI API's defaults (default: %(default)s)")
    server.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                        help="split a reply's <think>...</think> section into reasoning_content (and reasoning) "
                             "in chat completions; qwen3: replies that open with <think>; deepseek_r1: the "
                             "template opens it (default: no splitting)")
    server.add_argument("--tool-call-parser", choices=("auto", *TOOL_CALL_PARSERS), default="auto",
                        help="the format tool calls are parsed out of chat replies in, when a request gives tools "
                             "(auto: generic where the chat template ignores tools, which then go in a system "
                             "message asking for that format, else the one the template shows, else none; "
                             "tool_choice required or a named function works in any case, in the generic format "
                             "where no other applies; see docs/tool-calls.md; default: %(default)s)")
    server.add_argument("--pooling-type", choices=POOLING_TYPES, default=None,
                        help="how /v1/embeddings pools a prompt's final hidden states (default: the checkpoint's "
                             "pooling config, else last)")
    server.add_argument("--max-stored-responses", type=_non_negative_int, default=DEFAULT_MAX_STORED_RESPONSES,
                        help="the Responses API keeps this many recent responses (store: true) in memory, for "
                             "previous_response_id and GET /v1/responses/{id}; the least recently used go first "
                             "(0: keep none; default: %(default)s)")
    server.add_argument("--max-stored-response-bytes", type=_non_negative_int,
                        default=DEFAULT_MAX_STORED_RESPONSE_BYTES,
                        help="and at most this many bytes of them, conversations included (default: %(default)s)")
    server.add_argument("--no-web-ui", action="store_true",
                        help="do not serve the chat page at / (an API-only deployment)")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="least severe log messages shown on stderr: debug adds the engine's and plugins' "
                             "details, warning and error only problems (default: %(default)s)")
    tp = parser.add_argument_group("tensor parallelism", "with --tensor-parallel-size N > 1, this command starts "
                                   "N local ranks and supervises them; rank 0 serves HTTP")
    tp.add_argument("--no-tensor-parallel-supervisor", action="store_true",
                    help="run as the one rank that torchrun (or another launcher) set in RANK, WORLD_SIZE, "
                         "MASTER_ADDR and MASTER_PORT, on this machine or another")
    tp.add_argument("--tensor-parallel-ready-timeout", type=float, default=600.0, metavar="SECONDS",
                    help="how long every rank may take to load before the group is stopped (default: %(default)s)")
    add_engine_args(parser)  # --model, --backend and every other EngineArgs field
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "pocketllm-server") -> int:
    watch_parent()  # a rank the supervisor started ends with it
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser(prog).parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_args = engine_args_from(ns)
        if engine_args.backend_options:  # a named backend's, before the port is bound and the model read
            BackendRegistry().check_backend_options(engine_args)
        rank = rank_info() if engine_args.tensor_parallel_size > 1 else None
        if rank is not None:
            check_world(engine_args, rank)
    except PocketLLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if engine_args.tensor_parallel_size > 1 and rank is None:
        if ns.no_tensor_parallel_supervisor:
            print("error: --no-tensor-parallel-supervisor needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT "
                  "(as torchrun sets them)", file=sys.stderr)
            return 2
        if not (math.isfinite(ns.tensor_parallel_ready_timeout) and ns.tensor_parallel_ready_timeout > 0):
            print("error: --tensor-parallel-ready-timeout must be positive", file=sys.stderr)
            return 2
        # Each rank runs this same command line; the environment tells it which rank it is.
        return supervise([sys.executable, "-m", "pocketllm_server", *argv], engine_args.tensor_parallel_size,
                         ns.tensor_parallel_ready_timeout)
    if rank is not None and rank.rank > 0:
        try:
            run_worker(engine_args)
        except PocketLLMError as e:
            print(f"error: tensor-parallel rank {rank.rank}: {e}", file=sys.stderr)
            return 1
        return 0
    served_model_name = ns.served_model_name or os.path.basename(engine_args.model.rstrip("/\\"))
    app = create_app(engine_args, served_model_name=served_model_name, api_key=ns.api_key or None,
                     max_queue_len=ns.max_queue_len, max_request_bytes=ns.max_request_bytes,
                     generation_config=ns.generation_config, reasoning_parser=ns.reasoning_parser,
                     tool_call_parser=ns.tool_call_parser, pooling_type=ns.pooling_type,
                     web_ui=not ns.no_web_ui, max_stored_responses=ns.max_stored_responses,
                     max_stored_response_bytes=ns.max_stored_response_bytes)
    config = Config()
    address = f"[{ns.host}]:{ns.port}" if ":" in ns.host else f"{ns.host}:{ns.port}"
    config.bind = [address]
    # Hypercorn's loggers go through the root handler set up above: one format, no line printed twice.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.accesslog = logging.getLogger("hypercorn.access")
    # Bind before the model starts loading, so that a port in use fails at once rather than after the load.
    try:
        sockets = config.create_sockets()
    except OSError as e:
        log.error("cannot listen on %s: %s", address, e)
        return 1
    config.bind = [f"fd://{sock.detach()}" for sock in sockets.insecure_sockets]
    return asyncio.run(_serve(app, config))


async def _serve(app: Starlette, config: Config) -> int:
    state: ServerState = app.state.server
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    engine_died = False

    async def stop_if_load_fails_or_engine_dies() -> None:
        nonlocal engine_died
        await state.wait_loaded()
        if state.load_error is not None:
            stop.set()
            return
        mark_ready(0)
        # A dead engine serves nothing: exit non-zero so that a supervisor restarts the server.
        while state.llm is not None and state.llm.is_alive:
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
        if not state.draining:
            engine_died = True
            log.critical("the engine stopped (%s); exiting", state.llm.error if state.llm else "no engine")
            stop.set()

    async def shutdown_trigger() -> None:
        # Runs once the app's startup (which begins loading the model) has completed.
        watcher = asyncio.create_task(stop_if_load_fails_or_engine_dies())
        try:
            await stop.wait()
        finally:
            watcher.cancel()
        log.info("shutting down: refusing new requests and aborting the ones in flight")
        # Stopping the engine now ends every stream at once, instead of hypercorn waiting out its grace period.
        await state.shutdown()

    await serve(app, config, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]
    if state.load_error is not None or engine_died:
        return 1
    log.info("stopped")
    return 0
