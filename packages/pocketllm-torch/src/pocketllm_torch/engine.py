"""TorchEngine: the request-level Engine the core drives, one ``step`` at a time."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, cast

from pocketllm.backend import BackendStats, RequestDelta
from pocketllm.errors import UnsupportedOptionError
from pocketllm.sampling_params import SamplingParams
from pocketllm_torch.block_manager import BlockManager
from pocketllm_torch.config import TorchConfig
from pocketllm_torch.model_runner import ModelRunner
from pocketllm_torch.name import NAME
from pocketllm_torch.sampler import SamplingFailure
from pocketllm_torch.scheduler import Scheduler
from pocketllm_torch.sequence import Sequence
from pocketllm_torch.speculative import Drafter, accepts
from pocketllm_torch.state_cache import StateSlots
from pocketllm_torch.tensor_parallel import Group

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from pocketllm.args import EngineArgs
    from pocketllm.backend import SampledLogprobs
    from pocketllm.checkpoint import Checkpoint
    from pocketllm.pooling import PoolingParams
    from pocketllm.sampling_params import SamplingParams
    from pocketllm.structured import Constraint
    from pocketllm_torch.options import TorchOptions
    from pocketllm_torch.platform import Platform
    from pocketllm_torch.sampler import Outcome
    from pocketllm_torch.scheduler import ScheduledBatch


# What an embedding request's Sequence carries where a generation's parameters go: nothing samples it.
_EMBEDDING_PARAMS = SamplingParams(max_tokens=1)


def join_group(args: EngineArgs, config: TorchConfig, options: TorchOptions) -> Group | None:
    """This rank's tensor-parallel group (None at tensor_parallel_size 1), on every rank alike; what tensor
    parallelism does not run is refused before any rank waits for the others."""
    if args.tensor_parallel_size == 1:
        return None
    if args.speculative_method in ("mtp", "draft_model"):
        raise UnsupportedOptionError("speculative_method", NAME, f"{args.speculative_method!r} with "
                                     "tensor_parallel_size > 1 is not implemented: the drafting model is not "
                                     "split across ranks")
    return Group(config.platform, threads_chosen=options.num_threads is not None)


def serve_as_worker(args: EngineArgs, checkpoint: Checkpoint, options: TorchOptions, ready: Callable[[], None],
                    platform: Platform | None = None) -> None:
    """A rank other than 0 (see pocketllm.backend.TensorParallelBackend); ``platform`` as for TorchEngine."""
    config = TorchConfig.from_args(args, checkpoint.config, options, platform)
    tp = join_group(args, config, options)
    assert tp is not None
    try:
        runner = ModelRunner(config, checkpoint, tp)
        ready()
        runner.serve()
    finally:
        tp.close()


class TorchEngine:
    def __init__(self, args: EngineArgs, checkpoint: Checkpoint, options: TorchOptions,
                 platform: Platform | None = None) -> None:
        """``platform``: the device layer of a backend plugin that reuses this engine on its own device (see
        platform.py); by default this backend's own for ``args.device``."""
        self.config = TorchConfig.from_args(args, checkpoint.config, options, platform)
        self.tp = join_group(args, self.config, options)
        try:
            self.runner = ModelRunner(self.config, checkpoint, self.tp)
        except BaseException:
            if self.tp is not None:
                self.tp.close()
            raise
        self.block_manager = BlockManager(self.runner.num_kv_blocks, self.config.block_size,
                                          self.config.enable_prefix_caching)
        self.state_slots = StateSlots(self.config.max_num_seqs) if self.runner.state_cache is not None else None
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs, self.config.max_num_batched_tokens,
                                   self.config.prefill_chunk_size, self.state_slots, self.runner.snapshots,
                                   self.runner.verify_state_rows, self.runner.scored_rows_per_step)
        self.seqs: dict[str, Sequence] = {}
        self.drafter = (Drafter(args, self.config.speculative_max_batch) if args.speculative_method is not None
                        else None)
        # Seeds for requests without one: reproducible for a given engine seed and order of requests.
        self._seeds = random.Random(args.seed)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    constraint: Constraint | None = None) -> None:
        # The core has checked the prompt, the ids in it and the parameters (see pocketllm.backend.Engine).
        seed = None
        if not params.is_greedy:
            seed = self._seeds.getrandbits(63) if params.seed is None else params.seed
        eos = () if params.ignore_eos else self.config.model.eos_token_ids
        assert params.max_tokens is not None  # resolved by the core
        seq = Sequence(
            request_id=request_id,
            token_ids=list(prompt_token_ids),
            num_prompt_tokens=len(prompt_token_ids),
            params=params,
            max_output_tokens=params.max_tokens,
            stop_token_ids=frozenset((*params.stop_token_ids, *eos)),
            seed=seed,
            constraint=constraint,
        )
        if self.drafter is not None:
            self.drafter.start(seq)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def add_embedding_request(self, request_id: str, prompt_token_ids: list[int], params: PoolingParams) -> None:
        seq = Sequence(request_id=request_id, token_ids=list(prompt_token_ids),
                       num_prompt_tokens=len(prompt_token_ids), params=_EMBEDDING_PARAMS, max_output_tokens=0,
                       stop_token_ids=frozenset(), seed=None, pooling=params)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def step(self) -> list[RequestDelta]:
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running)
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        sampled = self.runner.run(batch)
        done: list[Sequence] = []
        deltas = [self._take(seq, i, new, batch, done) for i, (seq, new) in enumerate(zip(batch.seqs, sampled,
                                                                                         strict=True))
                  if new is not None]
        self.runner.catch_up(batch, done)
        self.scheduler.mark_computed(batch)
        self.runner.commit_states(batch)
        self.runner.save_snapshots(batch)
        for seq in done:
            del self.seqs[seq.request_id]
            self.scheduler.finish(seq)
        return deltas

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            seq = self.seqs.pop(request_id, None)
            if seq is not None:
                self.scheduler.finish(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> BackendStats:
        stats = BackendStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_kv_blocks_total=self.block_manager.num_blocks,
            num_kv_blocks_used=self.block_manager.num_used_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_cache_queries=self.block_manager.num_queried_tokens,
            num_prefix_cache_hits=self.block_manager.num_hit_tokens,
            num_state_snapshots=len(snapshots) if (snapshots := self.runner.snapshots) is not None else 0,
            num_state_snapshot_hits=snapshots.num_hits if snapshots is not None else 0,
            num_state_snapshot_evictions=snapshots.num_evictions if snapshots is not None else 0,
        )
        if self.drafter is not None:
            self.drafter.count_into(stats)
        return stats

    def shutdown(self) -> None:
        self.abort(list(self.seqs))
        if self.tp is not None:  # the other ranks' loops return
            try:
                self.tp.send(None)
            finally:
                self.tp.close()
        del self.runner  # the weights and the KV cache
        self.config.platform.release_cache()

    def _take(self, seq: Sequence, index: int, new: list[Outcome] | list[float], batch: ScheduledBatch,
              done: list[Sequence]) -> RequestDelta:
        """A sequence's part of the step: its embedding, or the tokens of its sampled rows (see ``_emit``); a
        finished sequence goes into ``done``."""
        if seq.pooling is not None:
            done.append(seq)
            return RequestDelta(request_id=seq.request_id, new_token_ids=[], finish_reason="stop",
                                embedding=cast("list[float]", new))
        rows = cast("list[Outcome]", new)
        drafts, seq.draft = seq.draft[:len(rows) - 1], []
        tokens, logprobs, reason, error = self._emit(seq, rows, drafts)
        if drafts and self.drafter is not None:
            accepted = next((j for j, (t, d) in enumerate(zip(tokens, drafts, strict=False)) if t != d),
                            min(len(tokens), len(drafts)))
            batch.num_new_tokens[index] = 1 + accepted  # the rows whose keys and values stay valid
            self.drafter.verified(seq, len(drafts), accepted)
        if reason is not None:
            done.append(seq)
        if reason == "error":
            return RequestDelta(request_id=seq.request_id, new_token_ids=[], finish_reason="error", error=error)
        last = tokens[-1] if tokens else None
        first = bool(tokens) and seq.num_output_tokens == len(tokens)
        return RequestDelta(
            request_id=seq.request_id,
            new_token_ids=tokens,
            logprobs=logprobs if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs if first and seq.params.prompt_logprobs is not None else None,
            finish_reason=reason,
            # Only an explicit stop token is reported; EOS speaks for itself.
            stop_token_id=last if reason == "stop" and last in seq.params.stop_token_ids else None,
        )

    @staticmethod
    def _emit(seq: Sequence, rows: list[Outcome], drafts: list[int]
              ) -> tuple[list[int], list[SampledLogprobs], str | None, str | None]:
        """Append a sequence's new tokens: row 0's, then, while row j kept draft j, row j + 1's, up to what ends
        the request. Returns them, their logprobs, the finish reason and an error message."""
        tokens: list[int] = []
        logprobs: list[SampledLogprobs] = []
        for j, row in enumerate(rows):
            if isinstance(row, SamplingFailure):
                return tokens, logprobs, "error", row.message
            token_id, lp = row
            if j < len(drafts) and accepts(token_id, drafts[j]):
                token_id = drafts[j]
            if seq.constraint is not None:
                seq.constraint.accept(token_id)
                if seq.constraint.error is not None:
                    return tokens, logprobs, "error", f"structured output: {seq.constraint.error}"
            seq.token_ids.append(token_id)
            tokens.append(token_id)
            if lp is not None:
                logprobs.append(lp)
            reason = seq.finish_reason()
            if reason is not None or j == len(drafts) or token_id != drafts[j]:
                return tokens, logprobs, reason, None
        raise AssertionError("a sampled sequence has rows")
