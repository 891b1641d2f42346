"""Checks of what was asked for against what a backend declares it can do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pocketllm.errors import UnsupportedOptionError

if TYPE_CHECKING:
    from pocketllm.args import EngineArgs
    from pocketllm.backend import Capabilities
    from pocketllm.model_config import ModelConfig
    from pocketllm.sampling_params import SamplingParams


def check_engine_args(backend: str, caps: Capabilities, args: EngineArgs, config: ModelConfig) -> None:
    """Raise UnsupportedOptionError for the first engine option ``caps`` rules out."""
    if config.architecture not in caps.architectures:
        raise UnsupportedOptionError("model", backend, f"architecture {config.architecture!r} is not one of "
                                     f"{', '.join(caps.architectures) or 'none'}")
    if args.tensor_parallel_size > 1 and not caps.tensor_parallel:
        raise UnsupportedOptionError("tensor_parallel_size", backend, "tensor parallelism is not implemented")
    if args.speculative_method is not None and args.speculative_method not in caps.speculative_methods:
        raise UnsupportedOptionError("speculative_method", backend, f"{args.speculative_method!r} is not one of "
                                     f"{', '.join(caps.speculative_methods) or 'none'}")
    if args.enable_prefix_caching and not caps.prefix_caching:
        raise UnsupportedOptionError("enable_prefix_caching", backend)
    device = args.device.split(":")[0]
    if device != "auto" and device not in caps.devices:
        raise UnsupportedOptionError("device", backend, f"{args.device!r}; supported: {', '.join(caps.devices)}")
    if args.dtype != "auto" and args.dtype not in caps.dtypes:
        raise UnsupportedOptionError("dtype", backend, f"{args.dtype!r}; supported: {', '.join(caps.dtypes)}")
    if args.kv_cache_dtype not in caps.kv_cache_dtypes:
        raise UnsupportedOptionError("kv_cache_dtype", backend,
                                     f"{args.kv_cache_dtype!r}; supported: {', '.join(caps.kv_cache_dtypes)}")
    for key in args.backend_options:
        if key not in caps.backend_options:
            raise UnsupportedOptionError(f"backend_options.{key}", backend,
                                         f"accepted keys: {', '.join(caps.backend_options) or 'none'}")


def check_sampling_params(backend: str, caps: Capabilities, params: SamplingParams) -> None:
    """Raise UnsupportedOptionError for a sampling option ``caps`` rules out."""
    if params.logprobs is not None and not caps.logprobs:
        raise UnsupportedOptionError("logprobs", backend)
    if params.logprobs is not None and params.logprobs > caps.max_logprobs:
        raise UnsupportedOptionError("logprobs", backend, f"at most {caps.max_logprobs} alternatives")
