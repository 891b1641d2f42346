"""Engine-wide settings, validated on construction and readable from ``POCKETLLM_*``."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pocketllm.errors import ConfigError
from pocketllm.limits import MAX_GRAMMAR_CACHE_MB, MAX_MODEL_LEN_CAP, MAX_NGRAM, MAX_SPECULATIVE_TOKENS

if TYPE_CHECKING:
    from pocketllm.model_config import ModelConfig

DEFAULT_MODEL = "smollm2-135m-instruct"
ENV_PREFIX = "POCKETLLM_"
SPECULATIVE_METHODS = ("ngram", "mtp", "draft_model")
"""``EngineArgs.speculative_method`` values; a backend lists those it runs in ``Capabilities.speculative_methods``."""
# An index as torch writes one (no leading zeros, ASCII digits), within its 8-bit DeviceIndex: torch.device reads
# "cuda:128" as -128 and refuses "cuda:01" and longer numbers with a RuntimeError of its own.
_DEVICE = re.compile(r"^(auto|cpu|(cuda|npu)(:(0|[1-9][0-9]{0,2}))?)$")
MAX_DEVICE_INDEX = 127


def _option(default: Any, help: str) -> Any:
    """A field with its one-line help: ``--help``, the env bridge and the docs all read it from here."""
    return field(default=default, metadata={"help": help})


@dataclass(slots=True, kw_only=True)
class EngineArgs:
    """How to build an engine. Every field is checked in ``__post_init__``."""

    model: str = _option(DEFAULT_MODEL, "model: a safetensors directory, a .gguf file, or an alias of a model "
                                        "shipped in a Python package")
    model_format: str = _option("auto", "checkpoint format: auto, safetensors or gguf")
    backend: str = _option("auto", "backend: auto (the best installed one here) or a name from `pocketllm backends`")
    device: str = _option("auto", "device: auto, cpu, cuda[:N] or npu[:N]")
    dtype: str = _option("auto", "weights and activations: auto (the backend's choice for this machine), float32, "
                                 "bfloat16 or float16")
    tensor_parallel_size: int = _option(1, "processes (devices) to split the model across")
    max_model_len: int | None = _option(None, "context length, prompt plus output, in tokens; none: the "
                                              f"model's own limit, at most {MAX_MODEL_LEN_CAP}")
    max_num_seqs: int = _option(32, "most requests running at once; more wait for a slot")
    max_num_batched_tokens: int = _option(2048, "most tokens one engine step processes")
    prefill_chunk_size: int = _option(512, "longest piece of one prompt prefilled in one step; while another "
                                            "sequence decodes, the most prompt tokens of one step in all")
    kv_cache_dtype: str = _option("auto", "KV-cache storage: auto (what attention computes in) or a float dtype")
    enable_prefix_caching: bool = _option(False, "reuse the KV of prompt prefixes seen before")
    speculative_method: str | None = _option(None, "speculative decoding: ngram (prompt lookup), mtp (the model's "
                                                   "multi-token-prediction layers) or draft_model, where the backend "
                                                   "has it (`pocketllm backends`)")
    num_speculative_tokens: int = _option(0, "tokens drafted per sequence and step by speculative decoding "
                                             f"(1-{MAX_SPECULATIVE_TOKENS}; needs speculative_method)")
    ngram_min: int | None = _option(None, "ngram: shortest suffix of the sequence looked up in it; "
                                          "1 where not given")
    ngram_max: int | None = _option(None, f"ngram: longest suffix looked up, tried first, at most {MAX_NGRAM}; "
                                          "4 where not given")
    draft_model: str | None = _option(None, "draft_model: the smaller model that drafts (a path or an alias, with "
                                            "the target's tokenizer)")
    speculative_disable_by_batch_size: int | None = _option(
        None, "speculative decoding drafts only while at most this many requests run (a batch that large is bound by "
              "compute, which verifying drafts adds to); none: the backend's measured default")
    seed: int = _option(0, "engine seed: the random stream of requests that set no seed of their own "
                           "(a request's `seed` wins)")
    grammar_cache_mb: int = _option(64, "memory for compiled structured-output grammars kept for reuse, in MiB "
                                        "(estimated from each spec's size); 0 keeps none")
    backend_options: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "backend-specific settings as a JSON object (each backend's keys, with their types, ranges, "
                "defaults and meaning: see `pocketllm backends`)"})

    def __post_init__(self) -> None:
        _check(isinstance(self.model, str) and bool(self.model), "model", "must be a non-empty string")
        _check(self.model_format in ("auto", "safetensors", "gguf"), "model_format",
               f"must be auto, safetensors or gguf, got {self.model_format!r}")
        _check(isinstance(self.backend, str) and bool(self.backend), "backend", "must be 'auto' or a backend name")
        device = _DEVICE.match(self.device) if isinstance(self.device, str) else None
        _check(device is not None and int(device.group(4) or 0) <= MAX_DEVICE_INDEX, "device",
               f"must be auto, cpu, cuda[:N] or npu[:N] (N from 0 to {MAX_DEVICE_INDEX}), got {self.device!r}")
        _check(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype",
               f"must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        _positive(self, "tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "prefill_chunk_size")
        _check(self.max_model_len is None or (_is_int(self.max_model_len) and self.max_model_len > 0),
               "max_model_len", f"must be a positive integer, got {self.max_model_len!r}")
        _check(isinstance(self.kv_cache_dtype, str) and bool(self.kv_cache_dtype), "kv_cache_dtype",
               "must be a non-empty string")
        _check(isinstance(self.enable_prefix_caching, bool), "enable_prefix_caching", "must be a bool")
        self._check_speculative()
        _check(_is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        _check(_is_int(self.grammar_cache_mb) and 0 <= self.grammar_cache_mb <= MAX_GRAMMAR_CACHE_MB,
               "grammar_cache_mb", f"must be an integer in [0, {MAX_GRAMMAR_CACHE_MB}], got {self.grammar_cache_mb!r}")
        _check(isinstance(self.backend_options, dict) and all(isinstance(k, str) for k in self.backend_options),
               "backend_options", "must be a dict with string keys")

    def _check_speculative(self) -> None:
        """The speculative-decoding fields (see "Speculative decoding" in pocketllm.backend). A method's own fields
        are refused without that method rather than ignored, and its defaults filled in with it."""
        method = self.speculative_method
        _check(method is None or method in SPECULATIVE_METHODS, "speculative_method",
               f"must be one of {', '.join(SPECULATIVE_METHODS)} or None, got {method!r}")
        tokens = self.num_speculative_tokens
        if method is None:
            _check(tokens == 0, "num_speculative_tokens", "needs speculative_method")
        else:
            _check(_is_int(tokens) and 1 <= tokens <= MAX_SPECULATIVE_TOKENS, "num_speculative_tokens",
                   f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] with speculative_method {method}, "
                   f"got {tokens!r}")
        if method == "ngram":
            self.ngram_min = 1 if self.ngram_min is None else self.ngram_min
            self.ngram_max = max(4, self.ngram_min) if self.ngram_max is None else self.ngram_max
            for name in ("ngram_min", "ngram_max"):
                value = getattr(self, name)
                _check(_is_int(value) and 1 <= value <= MAX_NGRAM, name,
                       f"must be an integer in [1, {MAX_NGRAM}], got {value!r}")
            _check(self.ngram_min <= self.ngram_max, "ngram_min",
                   f"must be at most ngram_max ({self.ngram_max}), got {self.ngram_min}")
        else:
            for name in ("ngram_min", "ngram_max"):
                _check(getattr(self, name) is None, name, "needs speculative_method ngram")
        limit = self.speculative_disable_by_batch_size
        if method is None:
            _check(limit is None, "speculative_disable_by_batch_size", "needs speculative_method")
        else:
            _check(limit is None or (_is_int(limit) and limit >= 1), "speculative_disable_by_batch_size",
                   f"must be a positive integer or None, got {limit!r}")
        if method == "draft_model":
            _check(isinstance(self.draft_model, str) and bool(self.draft_model), "draft_model",
                   "speculative_method draft_model needs a draft_model (a path or an alias)")
        else:
            _check(self.draft_model is None, "draft_model", "needs speculative_method draft_model")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **explicit: Any) -> EngineArgs:
        """Build from ``POCKETLLM_<FIELD>`` variables; keyword arguments win over the environment."""
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(f"{ENV_PREFIX}{f.name.upper()}")
            if raw is not None and f.name not in explicit:
                values[f.name] = _parse_env(f.name, f.type, raw)
        values.update(explicit)
        return cls(**values)


def _parse_env(name: str, type_: Any, raw: str) -> Any:
    kind = str(type_)
    try:
        if kind == "bool":
            if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("1", "true", "yes")
        if kind.startswith("int"):
            return None if raw.lower() in ("", "none") and "None" in kind else int(raw)
        if kind.startswith("dict"):
            return json.loads(raw)
        if "None" in kind and raw.lower() in ("", "none"):
            return None
        return raw
    except ValueError as e:
        raise ConfigError(name, f"cannot parse POCKETLLM_{name.upper()}={raw!r}: {e}") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive(args: EngineArgs, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        _check(_is_int(value) and value > 0, name, f"must be a positive integer, got {value!r}")


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise ConfigError(field_name, message)


def resolve_max_model_len(args: EngineArgs, config: ModelConfig) -> int:
    """``args.max_model_len``, or the model's own limit capped at MAX_MODEL_LEN_CAP; never beyond the model's."""
    limit = config.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > limit:
        raise ConfigError("max_model_len", f"{args.max_model_len} exceeds the model's limit of {limit} positions")
    return args.max_model_len or min(limit, MAX_MODEL_LEN_CAP)
