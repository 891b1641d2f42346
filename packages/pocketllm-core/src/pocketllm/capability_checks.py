"""Checks of what was asked for against what a backend declares it can do: the one place that refuses.

Everything here runs before ``create_engine`` or ``Engine.add_request``, so a backend never re-checks it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from pocketllm import backend_options
from pocketllm.checkpoint import load_checkpoint
from pocketllm.errors import CheckpointError, ConfigError, PromptTooLongError, UnsupportedOptionError
from pocketllm.limits import MAX_PROMPT_LOGPROB_ENTRIES
from pocketllm.pooling import POOLING_TYPES

if TYPE_CHECKING:
    from pocketllm.args import EngineArgs
    from pocketllm.backend import Capabilities
    from pocketllm.backend_options import BackendOptions
    from pocketllm.checkpoint import Checkpoint, CheckpointTensor
    from pocketllm.pooling import PoolingParams
    from pocketllm.sampling_params import SamplingParams


def check_engine_args(backend: str, caps: Capabilities, args: EngineArgs, checkpoint: Checkpoint) -> BackendOptions:
    """Raise UnsupportedOptionError for the first engine option or checkpoint property ``caps`` rules out, or
    ConfigError for a backend option of the wrong type or out of range; return the backend options, resolved
    into the backend's ``Capabilities.backend_options`` class, for ``create_engine``."""
    _check_servable(checkpoint, caps, backend, "model", "quantization")
    if args.tensor_parallel_size > 1 and not caps.tensor_parallel:
        raise UnsupportedOptionError("tensor_parallel_size", backend, "tensor parallelism is not implemented")
    if args.speculative_method is not None and args.speculative_method not in caps.speculative_methods:
        raise UnsupportedOptionError("speculative_method", backend, f"{args.speculative_method!r} is not one of "
                                     f"{', '.join(caps.speculative_methods) or 'none'}")
    if args.speculative_method == "mtp":
        _check_mtp(checkpoint, caps, backend)
    if args.speculative_method == "draft_model":
        _check_draft_model(args, checkpoint, caps, backend)
    if args.enable_prefix_caching and not caps.prefix_caching:
        raise UnsupportedOptionError("enable_prefix_caching", backend)
    if caps.max_num_seqs is not None and args.max_num_seqs > caps.max_num_seqs:
        raise UnsupportedOptionError("max_num_seqs", backend, f"at most {caps.max_num_seqs}")
    device = args.device.split(":")[0]
    if device != "auto" and device not in caps.devices:
        raise UnsupportedOptionError("device", backend, f"{args.device!r}; supported: {', '.join(caps.devices)}")
    if args.dtype != "auto" and args.dtype not in caps.dtypes:
        raise UnsupportedOptionError("dtype", backend, f"{args.dtype!r}; supported: {', '.join(caps.dtypes)}")
    if args.kv_cache_dtype not in caps.kv_cache_dtypes:
        raise UnsupportedOptionError("kv_cache_dtype", backend,
                                     f"{args.kv_cache_dtype!r}; supported: {', '.join(caps.kv_cache_dtypes)}")
    return backend_options.resolve(backend, caps.backend_options, args.backend_options)


def sampling_options_in_use(params: SamplingParams) -> list[str]:
    """The optional sampling features (names from ``backend.SAMPLING_OPTIONS``) that ``params`` asks for."""
    sampling = not params.is_greedy
    used = {
        "temperature": sampling,
        # Truncation and seeds only change what a random draw picks: greedy decoding ignores them by definition.
        "top_p": sampling and params.top_p < 1.0,
        "top_k": sampling and params.effective_top_k > 0,
        "min_p": sampling and params.min_p > 0.0,
        "seed": sampling and params.seed is not None,
        "presence_penalty": params.presence_penalty != 0.0,
        "frequency_penalty": params.frequency_penalty != 0.0,
        "repetition_penalty": params.repetition_penalty != 1.0,
        "logit_bias": bool(params.logit_bias),
        "min_tokens": params.min_tokens > 0,
        "logprobs": params.logprobs is not None,
        "prompt_logprobs": params.prompt_logprobs is not None,
    }
    return [name for name, on in used.items() if on]


def check_request(backend: str, caps: Capabilities, prompt_ids: list[int], params: SamplingParams, *,
                  vocab_size: int, max_model_len: int) -> SamplingParams:
    """Refuse a request the engine must not see, or return its parameters as the engine gets them (``max_tokens``
    resolved against the room left): see ``Engine.add_request`` for what the engine may then assume."""
    if not prompt_ids:
        raise ConfigError("prompt", "must not be empty")
    _check_prompt_ids(prompt_ids, vocab_size)
    if len(prompt_ids) >= max_model_len:
        raise PromptTooLongError(f"prompt has {len(prompt_ids)} tokens; max_model_len is {max_model_len}, "
                                 "which leaves no room to generate")
    for field, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
        if any(not 0 <= t < vocab_size for t in ids):
            raise ConfigError(field, f"token ids must be in [0, {vocab_size})")
    if params.top_k > vocab_size:
        raise ConfigError("top_k", f"must be -1, 0 or at most the vocabulary size {vocab_size}, got {params.top_k}")
    for option in sampling_options_in_use(params):
        if option not in caps.sampling_options:
            raise UnsupportedOptionError(option, backend)
    if params.structured_outputs is not None and not caps.structured_outputs:
        raise UnsupportedOptionError("structured_outputs", backend, "it has no grammar-constrained decoding")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > caps.max_logprobs:
            raise UnsupportedOptionError(name, backend, f"at most {caps.max_logprobs} alternatives")
    if params.n > caps.max_n:
        raise UnsupportedOptionError("n", backend, f"at most {caps.max_n} choices")
    check_prompt_logprob_entries(prompt_logprob_entries(len(prompt_ids), params))
    room = max_model_len - len(prompt_ids)
    return msgspec.structs.replace(params, max_tokens=room if params.max_tokens is None else min(params.max_tokens,
                                                                                                 room))


def prompt_logprob_entries(prompt_tokens: int, params: SamplingParams) -> int:
    """The prompt logprobs a request of ``prompt_tokens`` asks for (see MAX_PROMPT_LOGPROB_ENTRIES)."""
    return 0 if params.prompt_logprobs is None else prompt_tokens * (params.prompt_logprobs + 1) * params.n


def check_prompt_logprob_entries(entries: int, limit: int = MAX_PROMPT_LOGPROB_ENTRIES, what: str = "prompt") -> None:
    if entries > limit:
        raise ConfigError("prompt_logprobs", f"asks for {entries:,} prompt logprobs (prompt tokens x (alternatives + "
                                             f"1) x choices); at most {limit:,} a {what}")


def check_embedding_request(backend: str, caps: Capabilities, prompt_ids: list[int], params: PoolingParams, *,
                            vocab_size: int, max_model_len: int, hidden_size: int,
                            default_pooling: str) -> PoolingParams:
    """As ``check_request``, for ``EmbeddingEngine.add_embedding_request``: the parameters with the pooling
    type resolved (the request's, else the checkpoint's ``default_pooling``)."""
    if not caps.pooling_types:
        raise UnsupportedOptionError("embeddings", backend, "it does not pool hidden states")
    pooling = params.pooling_type or default_pooling
    if pooling not in POOLING_TYPES:  # PoolingParams checks its own: this is the checkpoint's
        raise ConfigError("pooling_type", f"the checkpoint pools with {pooling!r}, which is not one of "
                                          f"{', '.join(POOLING_TYPES)}: name one")
    if pooling not in caps.pooling_types:
        raise UnsupportedOptionError("pooling_type", backend,
                                     f"{pooling!r}; supported: {', '.join(caps.pooling_types)}")
    if params.dimensions is not None and params.dimensions != hidden_size:
        raise UnsupportedOptionError("dimensions", backend, f"the model's embeddings have {hidden_size} dimensions "
                                     "and it is not trained for shortened (Matryoshka) ones")
    if not prompt_ids:
        raise ConfigError("prompt", "must not be empty")
    _check_prompt_ids(prompt_ids, vocab_size)
    if len(prompt_ids) > max_model_len:
        raise PromptTooLongError(f"input has {len(prompt_ids)} tokens; max_model_len is {max_model_len}")
    return msgspec.structs.replace(params, pooling_type=pooling)


def _check_prompt_ids(prompt_ids: list[int], vocab_size: int) -> None:
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in prompt_ids):
        raise ConfigError("prompt", f"token ids must be integers in [0, {vocab_size})")


def _check_mtp(checkpoint: Checkpoint, caps: Capabilities, backend: str) -> None:
    """``speculative_method="mtp"`` runs the checkpoint's own multi-token-prediction layers: it needs some, stored
    as the backend reads."""
    tensors = checkpoint.mtp_tensors()
    if not tensors:
        raise UnsupportedOptionError("speculative_method", backend, "'mtp' runs the checkpoint's multi-token-"
                                     "prediction layers, and it has none")
    _check_storage(tensors, caps, backend, "quantization")


def _check_draft_model(args: EngineArgs, checkpoint: Checkpoint, caps: Capabilities, backend: str) -> None:
    """``speculative_method="draft_model"``: a checkpoint the backend serves, whose tokens are the target's (the same
    vocabulary size: its ids are verified as the target's)."""
    assert args.draft_model is not None  # EngineArgs checks it is given
    try:
        draft = load_checkpoint(args.draft_model)
    except CheckpointError as e:  # said as the draft model's, not the model's
        raise CheckpointError(f"draft_model: {e}") from None
    if draft.config.vocab_size != checkpoint.config.vocab_size:
        raise ConfigError("draft_model", f"{args.draft_model} has a vocabulary of {draft.config.vocab_size} tokens, "
                                         f"the model {checkpoint.config.vocab_size}: a draft model shares the model's")
    _check_servable(draft, caps, backend, "draft_model", "draft_model")


def _check_servable(checkpoint: Checkpoint, caps: Capabilities, backend: str, model_option: str,
                    storage_option: str) -> None:
    """The backend runs the checkpoint's architecture and reads every tensor's storage type; the errors name the
    options given."""
    architecture = checkpoint.config.architecture
    if architecture not in caps.architectures:
        raise UnsupportedOptionError(model_option, backend, f"architecture {architecture!r} is not one of "
                                     f"{', '.join(caps.architectures) or 'none'}")
    _check_storage(checkpoint.tensors(), caps, backend, storage_option)


def _check_storage(tensors: list[CheckpointTensor], caps: Capabilities, backend: str, option: str) -> None:
    for tensor in tensors:
        if tensor.storage_type not in caps.storage_types:
            raise UnsupportedOptionError(option, backend, f"tensor {tensor.name!r} is stored as "
                                         f"{tensor.storage_type}; supported: {', '.join(caps.storage_types)}")
