"""Where the Triton kernels (``triton_kernels``) replace the torch ops of the models: on CUDA tensors where triton is
installed. ``POCKETLLM_TORCH_KERNELS`` overrides it: ``torch`` keeps the torch ops everywhere, ``triton`` takes the
kernels on any device (on CPU under Triton's interpreter, ``TRITON_INTERPRET=1``: how the tests run a whole model
through them without a GPU); ``auto`` (the default) is the rule above."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from pocketllm.errors import UnsupportedOptionError
from pocketllm_torch import triton_kernels
from pocketllm_torch.name import NAME

KERNELS_ENV = "POCKETLLM_TORCH_KERNELS"
CHOICES = ("auto", "torch", "triton")


def choice() -> str:
    value = os.environ.get(KERNELS_ENV, "auto")
    if value not in CHOICES:
        raise UnsupportedOptionError(KERNELS_ENV, NAME, f"{value!r} is not one of {', '.join(CHOICES)}")
    if value == "triton" and not triton_kernels.available():
        raise UnsupportedOptionError(KERNELS_ENV, NAME, "triton is not installed (pip install triton)")
    return value


def use_triton(x: Tensor) -> bool:
    """Whether the ops on ``x`` run the Triton kernels: never while a decode trace records (it records torch ops)."""
    kernels = choice()
    if torch.jit.is_tracing():
        return False
    return kernels == "triton" or (kernels == "auto" and x.is_cuda and triton_kernels.available())


def keeps_groups(device: torch.device) -> bool:
    """Whether GGUF's 4- and 8-bit matrices stay in their groups on ``device`` for the Triton GEMM, which
    dequantizes a tile at a time (``POCKETLLM_TORCH_KERNELS=torch`` dequantizes them at load instead)."""
    kernels = choice()
    return kernels == "triton" or (kernels == "auto" and device.type == "cuda" and triton_kernels.available())


# The kernels, imported on first use: an install without triton never imports it.
def rms_norm(x: Tensor, weight: Tensor, eps: float, delta: Tensor | None = None) -> tuple[Tensor, Tensor]:
    from pocketllm_torch.triton_kernels.elementwise import rms_norm as kernel

    return kernel(x, weight, eps, delta)


def silu_mul(gate_up: Tensor) -> Tensor:
    from pocketllm_torch.triton_kernels.elementwise import silu_mul as kernel

    return kernel(gate_up)


def rotary_(x: Tensor, cos: Tensor, sin: Tensor, *, interleaved: bool) -> None:
    from pocketllm_torch.triton_kernels.rotary import rotary_ as kernel

    kernel(x, cos, sin, interleaved=interleaved)


def paged_attention(q: Tensor, kv_cache: Tensor, block_tables: Tensor, token_seq: Tensor, token_pos: Tensor,
                    block_size: int, scale: float) -> Tensor:
    from pocketllm_torch.triton_kernels.attention import paged_attention as kernel

    return kernel(q, kv_cache, block_tables, token_seq, token_pos, block_size, scale)


def conv_update(x: Tensor, conv: Tensor, slots: Tensor, weight: Tensor) -> Tensor:
    from pocketllm_torch.triton_kernels.gated_delta import conv_update as kernel

    return kernel(x, conv, slots, weight)


def delta_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, slots: Tensor) -> Tensor:
    from pocketllm_torch.triton_kernels.gated_delta import delta_step as kernel

    return kernel(q, k, v, g, beta, state, slots)


def exponential_race(probs: Tensor, seeds: Tensor) -> Tensor:
    from pocketllm_torch.triton_kernels.sampling import exponential_race as kernel

    return kernel(probs, seeds)


def pack_int4(codes: Tensor) -> Tensor:
    from pocketllm_torch.triton_kernels.grouped_matmul import pack_int4 as pack

    return pack(codes)


def grouped_matmul(x: Tensor, codes: Tensor, scale: Tensor, offset: Tensor | None,
                   out_dtype: torch.dtype | None) -> Tensor:
    from pocketllm_torch.triton_kernels.grouped_matmul import grouped_matmul as kernel

    return kernel(x, codes, scale, offset, out_dtype)
