"""Engine start-up: read the checkpoint, choose the backend, start tensor-parallel ranks, build the engine."""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any

from pocketllm.args import EngineArgs, resolve_max_model_len
from pocketllm.backend import BackendPlugin, Capabilities, Engine, TensorParallelBackend
from pocketllm.backend_options import BackendOptions
from pocketllm.capability_checks import check_engine_args
from pocketllm.checkpoint import Checkpoint, load_checkpoint
from pocketllm.checkpoint.shapes import check_model
from pocketllm.errors import (
    BrokenBackendError,
    CheckpointError,
    ConfigError,
    EngineDeadError,
    PocketLLMError,
    UnsupportedOptionError,
)
from pocketllm.plugins import BackendRegistry
from pocketllm.pooling import DEFAULT_POOLING_TYPE
from pocketllm.progress import LoadProgress
from pocketllm.sampling_defaults import recommended_defaults
from pocketllm.tensor_parallel import LocalRanks, check_world, rank_info
from pocketllm.tokenizer import Tokenizer
from pocketllm.warmup import warm_up

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A checkpoint read and checked, with what the core needs of it besides the weights."""

    args: EngineArgs  # with max_model_len resolved
    checkpoint: Checkpoint
    tokenizer: Tokenizer
    sampling_defaults: dict[str, Any]  # SamplingParams fields the checkpoint recommends
    default_pooling: str | CheckpointError  # a broken pooling config is raised by embeddings, not by the load


@dataclass(frozen=True, slots=True)
class ChosenBackend:
    plugin: BackendPlugin
    capabilities: Capabilities
    options: BackendOptions  # EngineArgs.backend_options, resolved into capabilities.backend_options


def read_model(args: EngineArgs, progress: LoadProgress) -> LoadedModel:
    with progress.stage(f"reading {args.model}"):
        checkpoint = load_checkpoint(args.model, args.model_format)
        check_model(checkpoint)  # a tensor missing or a layer count the tensors do not bear out
        return LoadedModel(args=dataclasses.replace(args, max_model_len=resolve_max_model_len(args, checkpoint.config)),
                           checkpoint=checkpoint, tokenizer=Tokenizer.from_checkpoint(checkpoint),
                           sampling_defaults=recommended_defaults(checkpoint), default_pooling=_pooling_of(checkpoint))


def choose_backend(model: LoadedModel, registry: BackendRegistry, progress: LoadProgress) -> ChosenBackend:
    """After the checkpoint: "auto" picks among the backends that can serve this model with these options."""
    args = model.args
    with progress.stage("finding a backend" if args.backend == "auto" else f"starting backend {args.backend}"):
        plugin = registry.select(args, model.checkpoint)
        capabilities = plugin.capabilities()
        options = check_engine_args(plugin.name, capabilities, args, model.checkpoint)
        return ChosenBackend(plugin, capabilities, options)


def start_ranks(args: EngineArgs, plugin: BackendPlugin) -> LocalRanks | None:
    """A library engine split across ranks starts its other ranks itself (a launcher has set RANK otherwise)."""
    if args.tensor_parallel_size == 1:
        return None
    if not isinstance(plugin, TensorParallelBackend):
        raise UnsupportedOptionError("tensor_parallel_size", plugin.name, "it declares tensor parallelism "
                                     "without run_tp_worker (TensorParallelBackend)")
    rank = rank_info()
    if rank is None or LocalRanks.active:
        return LocalRanks(args)
    check_world(args, rank)
    if rank.rank != 0:
        raise ConfigError("tensor_parallel_size", f"this process is rank {rank.rank}: ranks other than 0 "
                          "serve through pocketllm.tensor_parallel.run_worker(args), not an engine")
    return None


def build_engine(model: LoadedModel, backend: ChosenBackend) -> Engine:
    """Create the engine (on the thread that will step it) and warm it up; a model that computes NaN is refused
    here, its engine closed."""
    plugin = backend.plugin
    package = type(plugin).__module__.split(".")[0]
    try:
        engine = plugin.create_engine(model.args, model.checkpoint, backend.options)
    except PocketLLMError:  # the backend's own refusal (an option, the checkpoint) says what it is about
        raise
    except Exception as e:  # anything else is the backend's failure: say whose, not only what
        raise BrokenBackendError(f"backend {plugin.name!r} (from {package}) failed to create its engine: "
                                 f"{type(e).__name__}: {e}", plugin.name, package) from e
    if engine is None:
        raise BrokenBackendError(f"backend {plugin.name!r} returned no engine from create_engine", plugin.name,
                                 package)
    try:
        warm_up(engine, backend.capabilities, model.checkpoint.config, model.checkpoint.path)
    except BaseException:
        engine.shutdown()
        raise
    return engine


def await_built(built: Future[None], ranks: LocalRanks | None) -> None:
    """Wait for the engine thread's build; re-raises what it raised. A rank that dies before joining would leave
    rank 0 waiting to meet it: watch them meanwhile."""
    try:
        while not wait([built], timeout=0.2).done:
            failure = ranks.failure() if ranks is not None else None
            if failure is not None:
                raise EngineDeadError(f"tensor-parallel {failure}")
        built.result()
    except BaseException:
        if ranks is not None:
            ranks.abandon()
        raise


def _pooling_of(checkpoint: Checkpoint) -> str | CheckpointError:
    try:
        return checkpoint.pooling_type() or DEFAULT_POOLING_TYPE
    except CheckpointError as e:
        log.warning("%s: embeddings must name their pooling_type", e)
        return e
