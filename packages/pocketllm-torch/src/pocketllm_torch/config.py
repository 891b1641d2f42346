"""EngineArgs resolved for this machine and model, refusing what this backend cannot honour."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pocketllm.errors import UnsupportedOptionError
from pocketllm.kv_budget import KVBudget, bytes_per_block
from pocketllm.tensor_parallel import rank_info
from pocketllm_torch import triton_ops
from pocketllm_torch.attention import FP8
from pocketllm_torch.cpus import available_cpus
from pocketllm_torch.linear import compute_dtype
from pocketllm_torch.platform import Platform, for_device_name

if TYPE_CHECKING:
    from pocketllm.args import EngineArgs
    from pocketllm.model_config import ModelConfig
    from pocketllm_torch.options import TorchOptions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Speculative decoding drafts while at most this many sequences run (EngineArgs.speculative_disable_by_batch_size
# by default). Default model, 2 threads, the speculative bench's edit prompts, aggregate decode with drafts on
# against off: 3.27x at 1 sequence, 2.12x at 2, 1.62x at 4, 1.40x at 8, 1.09x at 16 (verification steps run
# eagerly, not from the decode traces, so the gain shrinks faster than on cpp): off past 16.
SPECULATIVE_MAX_BATCH = 16
# torch's intra-op threads before any engine set them: its own default (the physical cores of the affinity mask
# it loaded with), or what the process chose. An engine without num_threads takes at most these.
_THREADS_BEFORE = torch.get_num_threads()


@dataclass(slots=True, frozen=True, kw_only=True)
class TorchConfig:
    model: ModelConfig
    platform: Platform  # the device layer (platform.py)
    num_threads: int  # torch's intra-op threads (a tensor-parallel rank may take fewer: see tensor_parallel.py)
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk_size: int
    block_size: int
    num_kv_blocks: int | None  # None: size the cache from memory once the weights are loaded
    enable_prefix_caching: bool
    decode_graphs: bool  # replay decode steps from TorchScript traces (see decode_graphs.py)
    state_snapshot_bytes: int  # budget of the state layers' prefix-cache snapshots (see state_snapshots.py)
    speculative_method: str | None  # EngineArgs': what drafts
    draft_model: str | None  # speculative_method "draft_model": its path or alias
    speculative_max_batch: int  # speculative decoding drafts while at most this many sequences run

    @classmethod
    def from_args(cls, args: EngineArgs, model: ModelConfig, options: TorchOptions,
                  platform: Platform | None = None) -> TorchConfig:
        """``platform``: a plugin's device layer (its device type is what args.device names); by default this
        backend's own for args.device."""
        # The core has checked every option against this backend's Capabilities, options' types and ranges too.
        threads = options.num_threads or default_threads()
        torch.set_num_threads(threads)  # on the engine's thread, which runs the kernels
        platform = platform or for_device_name(args.device)
        name = platform.device_type if args.device == "auto" else args.device
        rank = rank_info() if args.tensor_parallel_size > 1 else None
        if rank is not None and not platform.ranks_share_memory and torch.device(name).index is None:
            name = f"{platform.device_type}:{rank.local_rank}"  # each rank its own device, named outright
        device = platform.resolve(name)
        if device.index is not None:  # the device that ops without a tensor to go by (and kernels) run on
            platform.bind(device.index)
        dtype = _resolve_dtype(args.dtype, platform)
        # "auto" stores what attention computes in, so that reading the cache converts nothing.
        kv_cache_dtype = (compute_dtype(device, dtype) if args.kv_cache_dtype == "auto"
                          else FP8 if args.kv_cache_dtype == "fp8" else _resolve_dtype(args.kv_cache_dtype, platform))
        assert args.max_model_len is not None  # resolved by the core
        return cls(
            model=model,
            platform=platform,
            num_threads=threads,
            device=device,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            prefill_chunk_size=args.prefill_chunk_size,
            block_size=options.block_size,
            num_kv_blocks=options.num_kv_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
            # On by default where it was measured: CPUs, where a small model's decode is bound by Python overhead
            # (not with the Triton kernels forced there: a trace cannot record them).
            decode_graphs=(platform.traces_decode and triton_ops.choice() != "triton" if options.decode_graphs is None
                           else options.decode_graphs),
            state_snapshot_bytes=options.state_snapshot_mb << 20,
            speculative_method=args.speculative_method,
            draft_model=args.draft_model,
            speculative_max_batch=(SPECULATIVE_MAX_BATCH if args.speculative_disable_by_batch_size is None
                                   else args.speculative_disable_by_batch_size),
        )

    def kv_bytes_per_block(self, num_attention_layers: int) -> int:
        m = self.model
        return bytes_per_block(num_layers=num_attention_layers, num_kv_heads=m.num_key_value_heads,
                               head_dim=m.head_dim, itemsize=self.kv_cache_dtype.itemsize, block_size=self.block_size)

    def resolve_num_kv_blocks(self, num_attention_layers: int, state_slot_bytes: int = 0, snapshot_bytes: int = 0,
                              ranks_here: int = 1, draft_bytes_per_block: int = 0) -> int:
        """The ``num_kv_blocks`` option, else what this device's budget holds (see pocketllm.kv_budget), measured
        now: on a GPU, once the weights are loaded. On a CPU, ``ranks_here`` tensor-parallel ranks share the
        machine's budget. A draft model's cache has as many blocks, ``draft_bytes_per_block`` each."""
        share = ranks_here if self.platform.ranks_share_memory else 1
        budget = KVBudget(block_size=self.block_size,
                          bytes_per_block=self.kv_bytes_per_block(num_attention_layers) + draft_bytes_per_block,
                          max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                          memory_bytes=self.platform.kv_memory_budget(self.device) // share,
                          device_bytes=self.platform.physical_memory(self.device), state_slot_bytes=state_slot_bytes,
                          snapshot_bytes=snapshot_bytes)
        return budget.num_blocks(self.num_kv_blocks)


def default_threads() -> int:
    """Intra-op threads without num_threads: the CPUs this process may use (affinity mask, cgroup quota: see
    cpus.py), at most torch's own default."""
    return min(_THREADS_BEFORE, available_cpus())


def _resolve_dtype(name: str, platform: Platform) -> torch.dtype:
    if name == "auto":
        return platform.auto_dtype()
    if name == "float16" and not platform.supports_float16():
        raise UnsupportedOptionError("dtype", platform.backend_name,
                                     f"float16 is not available on {platform.device_type}")
    return DTYPES[name]
