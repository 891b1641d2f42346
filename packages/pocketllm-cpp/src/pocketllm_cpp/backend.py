"""The cpp backend as the core sees it: its Capabilities and an engine factory over the native Engine."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

from pocketllm.backend import (
    API_VERSION,
    SAMPLING_OPTIONS,
    BackendStats,
    Capabilities,
    RequestDelta,
    SampledLogprobs,
    TokenLogprob,
)
from pocketllm.checkpoint import load_checkpoint
from pocketllm.errors import CheckpointError, ConfigError, UnsupportedOptionError
from pocketllm.kv_budget import KVBudget, bytes_per_block, snapshot_capacity
from pocketllm.limits import MAX_THREADS
from pocketllm.pooling import POOLING_TYPES
from pocketllm.structured import bitmask_words, fill_bitmasks
from pocketllm_cpp.name import NAME
from pocketllm_cpp.options import CppOptions

if TYPE_CHECKING:
    from types import ModuleType

    from pocketllm.args import EngineArgs
    from pocketllm.checkpoint import Checkpoint
    from pocketllm.pooling import PoolingParams
    from pocketllm.sampling_params import SamplingParams
    from pocketllm.structured import Constraint
    from pocketllm_cpp._native import TokenLogprobs

# KV-cache element types and their bytes; "auto" is float16, half the bytes attention reads per position.
KV_CACHE_DTYPES = {"float16": 2, "float32": 4}
KV_MEMORY_FRACTION = 0.25  # of physical RAM, as the torch backend
# Speculative decoding drafts while at most this many sequences run (EngineArgs.speculative_disable_by_batch_size
# by default). On the default model, 2 threads, edit prompts (python -m pocketbench.speculative --batches 8 16 32
# 64), drafting still paid at every batch measured (1.27x at 8, 1.40x at 16, 1.43x at 32, 2.74x at 64): the limit
# is the largest batch measured. Sequences whose drafts miss stop drafting on their own (speculative.h's pauses).
SPECULATIVE_MAX_BATCH = 64
_NO_MASK = np.zeros(0, np.uint32)
_NOTHING_ALLOWED = "no token may be sampled: the grammar (with min_tokens and logit_bias) allows none"


class CppBackend:
    name = NAME
    api_version = API_VERSION

    def probe(self) -> int:
        # Above torch's 10 on CPUs with the x86 SIMD kernels (faster than torch there: see bench/results); below
        # it elsewhere: the scalar path, and NEON, which is tested under emulation but not yet measured against
        # torch on ARM hardware. Raises (the reason `pocketllm backends` shows) when the native module cannot load.
        from pocketllm_cpp import _native

        return 15 if _native.best_isa() in ("avx2", "avx512", "amx") else 9

    def capabilities(self) -> Capabilities:
        from pocketllm_cpp.model import ARCHITECTURES, STORAGE_TYPES

        return Capabilities(
            architectures=ARCHITECTURES,
            storage_types=STORAGE_TYPES,
            sampling_options=SAMPLING_OPTIONS,
            prefix_caching=True,
            structured_outputs=True,
            pooling_types=POOLING_TYPES,
            speculative_methods=("ngram", "mtp", "draft_model"),
            devices=("cpu",),
            dtypes=("float32",),
            kv_cache_dtypes=("auto", *KV_CACHE_DTYPES),
            backend_options=CppOptions,
        )

    def create_engine(self, args: EngineArgs, checkpoint: Checkpoint, options: CppOptions) -> CppEngine:
        return CppEngine(args, checkpoint, options)


class CppEngine:
    """pocketllm.backend.Engine over the native engine: conversions only, the work is in C++."""

    def __init__(self, args: EngineArgs, checkpoint: Checkpoint, options: CppOptions) -> None:
        from pocketllm_cpp import _native
        from pocketllm_cpp.model import HYBRID, build_model, num_attention_layers, state_slot_bytes

        # The core has checked every option against this backend's Capabilities, options' types and ranges too.
        assert args.max_model_len is not None  # resolved by the core
        block_size = options.block_size
        if block_size > args.max_model_len:
            raise ConfigError("backend_options.block_size", f"{block_size} is larger than max_model_len "
                                                            f"{args.max_model_len}")
        config = checkpoint.config
        kv_dtype = "float16" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        # Only attention layers keep KV; hybrid models' state layers hold a slot per running request instead, and
        # with prefix caching snapshots of it, whose budget is memory they may come to hold: not the KV cache's.
        state_bytes = state_slot_bytes(checkpoint)
        snapshot_bytes = options.state_snapshot_mb << 20 if state_bytes and args.enable_prefix_caching else 0
        if snapshot_bytes:
            snapshot_capacity(snapshot_bytes, state_bytes, option="state_snapshot_mb")
        mtp = args.speculative_method == "mtp"
        # A draft model's KV pool has as many blocks, indexed by the same block tables (the core checked the file).
        draft = load_checkpoint(args.draft_model) if args.draft_model is not None else None
        if draft is not None and draft.config.architecture in HYBRID:
            raise UnsupportedOptionError("draft_model", NAME, f"a draft model of {draft.config.architecture!r} keeps "
                                         "state layers, which drafting does not run yet")
        per_block = sum(bytes_per_block(num_layers=num_attention_layers(c, mtp and c is checkpoint),
                                        num_kv_heads=c.config.num_key_value_heads, head_dim=c.config.head_dim,
                                        itemsize=KV_CACHE_DTYPES[kv_dtype], block_size=block_size)
                        for c in (checkpoint, draft) if c is not None)
        num_blocks = KVBudget(block_size=block_size, bytes_per_block=per_block, max_model_len=args.max_model_len,
                              max_num_seqs=args.max_num_seqs, memory_bytes=int(physical * KV_MEMORY_FRACTION),
                              device_bytes=physical, state_slot_bytes=state_bytes, snapshot_bytes=snapshot_bytes,
                              ).num_blocks(options.num_kv_blocks)
        # By default one thread per CPU this process may use (its affinity and cgroup quota), not the machine's.
        threads = options.num_threads or min(_native.available_cpus(), MAX_THREADS)
        self.num_threads = threads
        # Every request stops at these: one outside the vocabulary (metadata of 2^32 - 1) would fail them all.
        outside = [t for t in config.eos_token_ids if not 0 <= t < config.vocab_size]
        if outside:
            raise CheckpointError(f"{checkpoint.path}: eos_token_id {outside[0]} is outside the vocabulary "
                                  f"(vocab_size {config.vocab_size})")
        self.eos = tuple(config.eos_token_ids)
        self.model = build_model(checkpoint, num_blocks=num_blocks, block_size=block_size, num_threads=threads,
                                 exact_activations=options.exact_activations, kv_cache_dtype=kv_dtype,
                                 num_state_slots=args.max_num_seqs, mtp=mtp)
        drafting = None if draft is None else build_model(
            draft, num_blocks=num_blocks, block_size=block_size, num_threads=threads,
            exact_activations=options.exact_activations, kv_cache_dtype=kv_dtype)
        speculative = _native.SpeculativeConfig()
        if args.speculative_method is not None:
            speculative.num_tokens, speculative.mtp = args.num_speculative_tokens, mtp
            speculative.draft_model = drafting is not None
            if args.speculative_method == "ngram":
                assert args.ngram_min is not None and args.ngram_max is not None
                speculative.ngram_min, speculative.ngram_max = args.ngram_min, args.ngram_max
            speculative.max_batch = (SPECULATIVE_MAX_BATCH if args.speculative_disable_by_batch_size is None
                                     else args.speculative_disable_by_batch_size)
        self.engine = _native.Engine(self.model, args.max_num_seqs, args.max_num_batched_tokens,
                                     args.prefill_chunk_size, args.seed, args.enable_prefix_caching, snapshot_bytes,
                                     speculative, drafting)
        self.vocab_size = config.vocab_size
        # The module, loaded here once (importing this file must not need it: `pocketllm backends` lists a
        # backend whose native library is missing), and its finish reasons in the core's words.
        self.native: ModuleType = _native
        self.finish_reasons = {_native.Finish.none: None, _native.Finish.stop: "stop",
                               _native.Finish.length: "length", _native.Finish.error: "error"}
        self.constraints: dict[str, Constraint] = {}  # structured outputs: running requests' grammars

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    constraint: Constraint | None = None) -> None:
        # The core has checked the prompt and the parameters (see pocketllm.backend.Engine).
        sampling = self.native.SamplingConfig()
        sampling.max_tokens, sampling.min_tokens = params.max_tokens, params.min_tokens
        sampling.temperature, sampling.top_p, sampling.top_k = params.temperature, params.top_p, params.effective_top_k
        sampling.min_p, sampling.repetition_penalty = params.min_p, params.repetition_penalty
        sampling.presence_penalty, sampling.frequency_penalty = params.presence_penalty, params.frequency_penalty
        sampling.seed, sampling.logit_bias = params.seed, dict(params.logit_bias)
        sampling.stop_ids = list(dict.fromkeys([*params.stop_token_ids, *(() if params.ignore_eos else self.eos)]))
        sampling.request_stop_ids = list(params.stop_token_ids)
        sampling.logprobs = -1 if params.logprobs is None else params.logprobs
        sampling.prompt_logprobs = -1 if params.prompt_logprobs is None else params.prompt_logprobs
        # A grammar's mask follows each token, set between steps: its requests do not draft.
        self.engine.add_request(request_id, prompt_token_ids, sampling, constraint is None)
        if constraint is not None:
            self.constraints[request_id] = constraint
            try:
                self._set_masks([request_id])
            except BaseException:  # nothing is queued when add_request raises
                self.abort([request_id])
                raise

    def add_embedding_request(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams) -> None:
        assert params.pooling_type is not None  # resolved by the core
        self.engine.add_embedding_request(request_id, prompt_token_ids, self.native.Pooling[params.pooling_type],
                                          params.normalize)

    def step(self) -> list[RequestDelta]:
        deltas = []
        for delta in self.engine.step():
            request_id, reason = delta.request_id, self.finish_reasons[delta.finish]
            if delta.embedding is not None:
                deltas.append(RequestDelta(request_id=request_id, new_token_ids=[], finish_reason="stop",
                                           embedding=delta.embedding))
                continue
            if reason == "error":
                self.constraints.pop(request_id, None)
                deltas.append(RequestDelta(request_id=request_id, new_token_ids=[], finish_reason="error",
                                           error=_NOTHING_ALLOWED))
                continue
            constraint = self.constraints.get(request_id)
            if constraint is not None:
                for token in delta.tokens:
                    constraint.accept(token)
                if constraint.error is not None:  # the engine still runs it: stop it there too
                    self.abort([request_id])
                    deltas.append(RequestDelta(request_id=request_id, new_token_ids=[], finish_reason="error",
                                               error=f"structured output: {constraint.error}"))
                    continue
                if reason is not None:
                    del self.constraints[request_id]
            deltas.append(RequestDelta(request_id=request_id, new_token_ids=list(delta.tokens),
                                       logprobs=_sampled(delta.logprobs) or None,
                                       prompt_logprobs=_sampled(delta.prompt_logprobs) or None,
                                       finish_reason=reason, stop_token_id=delta.stop_token_id))
        # Each grammar moved on by its token: the masks for the next ones, in one parallel fill.
        self._set_masks([d.request_id for d in deltas if d.finish_reason is None and d.request_id in self.constraints])
        return deltas

    def _set_masks(self, request_ids: list[str]) -> None:
        masked = []
        for request_id in request_ids:
            if self.constraints[request_id].masks_next:
                masked.append(request_id)
            else:  # a reply still in its reasoning section may take any token: no mask for the sampler
                self.engine.set_allowed(request_id, _NO_MASK)
        if not masked:
            return
        masks = np.empty((len(masked), bitmask_words(self.vocab_size)), dtype=np.int32)
        fill_bitmasks([(i, self.constraints[r]) for i, r in enumerate(masked)], masks)
        for request_id, words in zip(masked, masks.view(np.uint32), strict=True):
            self.engine.set_allowed(request_id, words)

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        for request_id in ids:
            self.constraints.pop(request_id, None)
        self.engine.abort(ids)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def stats(self) -> BackendStats:
        s = self.engine.stats()
        return BackendStats(num_running=s.running, num_waiting=s.waiting, num_kv_blocks_total=s.blocks_total,
                            num_kv_blocks_used=s.blocks_used, num_preemptions=s.preemptions,
                            num_prefix_cache_queries=s.prefix_queries, num_prefix_cache_hits=s.prefix_hits,
                            num_state_snapshots=s.state_snapshots, num_state_snapshot_hits=s.state_snapshot_hits,
                            num_state_snapshot_evictions=s.state_snapshot_evictions,
                            num_spec_drafts=s.speculative.drafts, num_spec_draft_tokens=s.speculative.draft_tokens,
                            num_spec_accepted_tokens=s.speculative.accepted_tokens,
                            spec_accepted_per_position=list(s.speculative.accepted_per_position))

    def shutdown(self) -> None:
        del self.engine, self.model  # the KV pool and the worker threads go with them


def _sampled(entries: list[TokenLogprobs]) -> list[SampledLogprobs]:
    return [SampledLogprobs(lp.token, lp.logprob, lp.rank, [TokenLogprob(a.token, a.logprob) for a in lp.top])
            for lp in entries]
