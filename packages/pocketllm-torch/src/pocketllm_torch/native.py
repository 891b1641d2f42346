"""The optional native CPU kernels (``csrc/``, built as ``pocketllm_torch._C``) and the weight layouts they read.

They are torch operators (``torch.ops.pocketllm.*``), so decode traces record and replay them like any other
op. Where the extension was not built, or was built against another torch (whose C++ ABI may differ, so it is
not even loaded), ``available()`` is False; the model uses them only where ``enabled()``, on CPUs with AVX2,
and torch's own kernels elsewhere.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)

BLOCK_OUT = 16  # outputs per packed block
GROUP_SIZE = 32  # inputs per packed block


@functools.cache
def available() -> bool:
    try:
        from pocketllm_torch._built_for import TORCH_VERSION
    except ImportError:
        log.info("native CPU kernels not built, using torch's")
        return False
    if torch.__version__ != TORCH_VERSION:
        log.info("native CPU kernels built for torch %s, not %s: using torch's", TORCH_VERSION, torch.__version__)
        return False
    try:
        import pocketllm_torch._C  # noqa: F401  (registers torch.ops.pocketllm)
    except ImportError as e:
        log.info("native CPU kernels unavailable, using torch's (%s)", e)
        return False
    return True


@functools.cache
def enabled() -> bool:
    """Whether the model runs the native kernels: built for this torch, on a CPU with their AVX2 path.

    Elsewhere (ARM, say) their scalar path would be correct but slower than torch's own vectorised kernels.
    """
    return available() and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def takes_rows(x: Tensor) -> bool:
    """Whether the native row kernels (rms_norm, add_rms_norm, silu_mul) take x: contiguous 2-D float32 on CPU."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and enabled()


def kernel_isa(request: str = "") -> str:
    """The instruction set of the native kernels; pass "scalar" or "avx2" to switch (for tests)."""
    return torch.ops.pocketllm.kernel_isa(request)


def packs(shape: torch.Size | tuple[int, ...]) -> bool:
    """Whether a [N, K] weight packs: whole groups of inputs (outputs are padded to whole blocks with zeros)."""
    return shape[1] % GROUP_SIZE == 0


def packed_outputs(packed: Tensor) -> int:
    """The outputs a packed weight computes: its own, padded to whole blocks."""
    return packed.shape[0] * BLOCK_OUT


def pack_int4(codes: Tensor, scale: Tensor, offset: Tensor) -> Tensor:
    """``w = scale * codes + offset`` per 32 inputs ([N, K] uint8 codes, [N, K/32] float32) -> int4_linear's layout.

    uint8 [N/16, K/32, 384] (N rounded up): per block of 16 outputs x 32 inputs, 32 rows of 8 bytes (output j in
    the low nibble of byte j, output j + 8 in its high nibble), then the 16 scales and the 16 offsets as float32.
    """
    blocks = _blocks(codes)
    half = BLOCK_OUT // 2
    nibbles = (blocks[..., :half] | (blocks[..., half:] << 4)).flatten(2)
    return torch.cat((nibbles, _per_block(scale), _per_block(offset)), dim=-1).contiguous()


def pack_int8(codes: Tensor, scale: Tensor) -> Tensor:
    """``w = scale * codes`` per 32 inputs ([N, K] int8 codes, [N, K/32] float32) -> int8_linear's layout.

    uint8 [N/16, K/32, 576] (N rounded up): per block of 16 outputs x 32 inputs, 32 rows of 16 codes, then the 16
    scales.
    """
    return torch.cat((_blocks(codes.view(torch.uint8)).flatten(2), _per_block(scale)), dim=-1).contiguous()


def _blocks(codes: Tensor) -> Tensor:
    """[N, K] -> [N/16, K/32, 32 inputs, 16 outputs], N rounded up with zero codes."""
    n, k = codes.shape
    if not packs(codes.shape):
        raise ValueError(f"a [{n}, {k}] weight is not made of whole groups of {GROUP_SIZE} inputs")
    codes = _pad_outputs(codes)
    return codes.reshape(-1, BLOCK_OUT, k // GROUP_SIZE, GROUP_SIZE).permute(0, 2, 3, 1)


def _per_block(t: Tensor) -> Tensor:
    """[N, K/32] float32 -> [N/16, K/32, 16 outputs] as bytes, N rounded up with zeros."""
    groups = t.shape[1]
    t = _pad_outputs(t.to(torch.float32))
    return t.reshape(-1, BLOCK_OUT, groups).transpose(1, 2).contiguous().view(torch.uint8)


def _pad_outputs(t: Tensor) -> Tensor:
    """t [N, ...] with zero rows up to a whole number of blocks of outputs."""
    return torch.nn.functional.pad(t, (0, 0, 0, -len(t) % BLOCK_OUT))


def int4_linear(x: Tensor, packed: Tensor, out_features: int) -> Tensor:
    """float32 x [M, K] @ the packed 4-bit weight's [K, N] -> float32 [M, N]."""
    return torch.ops.pocketllm.int4_linear(x, packed, out_features)


def int8_linear(x: Tensor, packed: Tensor, out_features: int) -> Tensor:
    """float32 x [M, K] @ the packed 8-bit weight's [K, N] -> float32 [M, N]."""
    return torch.ops.pocketllm.int8_linear(x, packed, out_features)


def paged_decode_attention(q: Tensor, kv_cache: Tensor, context_blocks: Tensor, context_lens: Tensor,
                           block_size: int, scale: float) -> Tensor:
    """One query per sequence, q [B, H, D], over its cached context in kv_cache [2, Hkv, slots, D] (float32).

    Sequence b reads positions 0 .. context_lens[b] - 1 through its blocks ``context_blocks[b]``; -> [B, H * D].
    """
    return torch.ops.pocketllm.paged_decode_attention(q, kv_cache, context_blocks, context_lens, block_size, scale)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` per row of x [M, H] (float32)."""
    return torch.ops.pocketllm.rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, delta: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(x + delta, rms_norm(x + delta))``: a residual add and the norm after it, in one pass."""
    return torch.ops.pocketllm.add_rms_norm(x, delta, weight, eps)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``silu(gate) * up`` for gate_up [M, 2I] = [gate | up] (float32) -> [M, I]."""
    return torch.ops.pocketllm.silu_mul(gate_up)


def gated_delta_decode(proj: Tensor, conv_pool: Tensor, recurrent_pool: Tensor, slots: Tensor, conv_weight: Tensor,
                       decay_rate: Tensor, dt_bias: Tensor, norm_weight: Tensor, num_k_heads: int,
                       tiled_heads: bool, eps: float) -> Tensor:
    """One decode step of a Gated DeltaNet layer (float32): its input projection's rows [B, q k v | z | b | a]
    -> the gated-normed outputs [B, Hv * dv] for its output projection; the step's slots of the convolution and
    recurrent state pools move on in place (see csrc/gated_delta.cpp). Value head h reads key head
    h // (Hv / Hk), or h % Hk where ``tiled_heads``."""
    return torch.ops.pocketllm.gated_delta_decode(proj, conv_pool, recurrent_pool, slots, conv_weight, decay_rate,
                                                  dt_bias, norm_weight, num_k_heads, tiled_heads, eps)
