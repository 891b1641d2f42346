"""A stand-in for torch_npu on machines without an Ascend NPU: what pocketllm-ascend's tests import as torch_npu.

Importing it does what importing the real torch_npu does for the code under test: device type ``npu`` exists
(PyTorch's PrivateUse1 device, renamed), ``torch.npu`` answers for it, torch.distributed has an ``hccl`` backend
for its tensors, and the fused operators that pocketllm-ascend calls are here. Behind it:

* An ``npu`` tensor is a wrapper (``NpuTensor``) around a CPU tensor that holds its values. Every aten op on it
  runs the CPU op on the wrapped tensors and wraps what comes back (views stay views of the same memory, in-place
  ops write it), so a model runs unchanged. What a real device refuses, this refuses too: an op that mixes npu
  tensors with CPU tensors of one or more dimensions (CPU scalars excepted, as on CUDA), or npu tensors of two
  devices, raises, which is how the tests show that no tensor silently stays on or moves to the wrong device.
  ``numpy()`` of an npu tensor raises.
* ``hccl`` is gloo on the wrapped CPU tensors, so tensor parallelism goes through the same code path as on NPUs
  (``init_process_group("cpu:gloo,npu:hccl")``), with what HCCL has: all-reduce, all-gather and broadcast (no
  gather), each tensor on its rank's own device.
* The fused operators are written in torch ops after torch_npu's documented semantics (the real ones are CANN
  kernels): ``npu_rms_norm``, ``npu_add_rms_norm``, ``npu_swiglu``, ``npu_rotary_mul`` and
  ``npu_fused_infer_attention_score`` (its dense form: BNSD layout, a boolean mask where True hides a key).

Put this directory on PYTHONPATH to use it (the tests' conftest does, for this process and the tensor-parallel
ranks it starts).
"""

from __future__ import annotations

import datetime
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

__version__ = "0.0.0+standin"
DEVICE_COUNT = 2
TOTAL_MEMORY = 8 << 30  # what each stand-in device reports: enough for the tests' tiny models

_current = 0


class NpuTensor(torch.Tensor):
    """An npu tensor: its values in ``cpu`` (a CPU tensor of the same shape, strides and dtype)."""

    cpu_values: torch.Tensor
    __slots__ = ("cpu_values",)

    @staticmethod
    def __new__(cls, values: torch.Tensor, index: int = 0) -> NpuTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, values.size(), strides=values.stride(), storage_offset=values.storage_offset(), dtype=values.dtype,
            layout=values.layout, device=torch.device("npu", index), requires_grad=False)
        wrapper.cpu_values = values
        return wrapper

    def __repr__(self) -> str:
        return f"NpuTensor({self.cpu_values!r}, device='{self.device}')"

    def tolist(self) -> Any:  # torch refuses tolist() of tensor subclasses; a device tensor has it
        return self.cpu_values.tolist()

    def numpy(self, *, force: bool = False) -> Any:
        raise TypeError("can't convert npu:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        index = _index_of(func, args, kwargs)
        crosses = func in _CROSSING

        def unwrap(x: Any) -> Any:
            if isinstance(x, NpuTensor):
                return x.cpu_values
            if isinstance(x, torch.Tensor) and not crosses and x.dim() > 0:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                   f"devices, npu:{index} and {x.device}! ({func}, a {tuple(x.shape)} tensor)")
            if isinstance(x, torch.device) and x.type == "npu":
                return torch.device("cpu")
            return x

        result = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None \
                and kwargs["device"].type != "npu":
            return result  # .cpu(), .to("cpu"): a CPU tensor
        # A view shares its base's version counter, which autograd sets after this returns: the wrapper is an
        # inference tensor exactly when its base is (a KV cache made outside inference mode, viewed inside it).
        base = next((a for a in args if isinstance(a, NpuTensor)), None)
        inference = base.is_inference() if base is not None and func.is_view else torch.is_inference_mode_enabled()
        with torch.inference_mode(inference):
            return tree_map(lambda x: NpuTensor(x, index) if type(x) is torch.Tensor else x, result)


# Ops whose point is to move values between devices.
_CROSSING = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}


def _index_of(func: Any, args: Any, kwargs: Any) -> int:
    """The device an op's results go to: the one it names, else its npu tensors' (which must agree, as on a
    device: copies excepted), else the current one."""
    device = kwargs.get("device")
    if isinstance(device, torch.device) and device.type == "npu":
        return _index(device)
    indices = {x.device.index for x in tree_flatten((args, kwargs))[0] if isinstance(x, NpuTensor)}
    if len(indices) > 1 and func not in _CROSSING:
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{', '.join(f'npu:{i}' for i in sorted(indices))}! ({func})")
    return min(indices) if indices else _current


class _DeviceProperties(types.SimpleNamespace):
    name: str
    total_memory: int


class _NpuModule(types.ModuleType):
    """``torch.npu`` as the code under test calls it."""

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def _is_in_bad_fork(self) -> bool:
        return False

    def device_count(self) -> int:
        return DEVICE_COUNT

    def current_device(self) -> int:
        return _current

    def set_device(self, device: int | str | torch.device) -> None:
        global _current
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if not 0 <= index < DEVICE_COUNT:
            raise RuntimeError(f"invalid device ordinal {index}")
        _current = index

    def manual_seed_all(self, seed: int) -> None:
        del seed

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        del device
        return TOTAL_MEMORY // 2, TOTAL_MEMORY

    def get_device_properties(self, device: Any = None) -> _DeviceProperties:
        del device
        return _DeviceProperties(name="stand-in NPU (CPU memory)", total_memory=TOTAL_MEMORY)

    def empty_cache(self) -> None:
        pass


npu = _NpuModule("torch.npu")
_setup_privateuseone_for_python_backend("npu", backend_module=npu)


@torch.library.impl("aten::empty.memory_format", "privateuseone")
def _empty(size: Any, *, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None,
           memory_format: Any = None) -> NpuTensor:
    values = torch.empty(size, dtype=dtype, memory_format=memory_format or torch.contiguous_format)
    return NpuTensor(values, _index(device))


@torch.library.impl("aten::empty_strided", "privateuseone")
def _empty_strided(size: Any, stride: Any, *, dtype: Any = None, layout: Any = None, device: Any = None,
                   pin_memory: Any = None) -> NpuTensor:
    return NpuTensor(torch.empty_strided(size, stride, dtype=dtype), _index(device))


def _index(device: torch.device | None) -> int:
    """A device's index; "npu" alone is the current device, as torch.npu.set_device chose."""
    return device.index if device is not None and device.index is not None else _current


@torch.library.impl("aten::_copy_from", "privateuseone")
def _copy_from(src: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    values = src.cpu_values if isinstance(src, NpuTensor) else src
    (dst.cpu_values if isinstance(dst, NpuTensor) else dst).copy_(values)
    return dst


# The fused operators, after torch_npu's documentation.

def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(x * rstd * gamma in x's dtype, rstd in float32), rstd = 1 / sqrt(mean(x^2) + epsilon) over the last dims
    that gamma spans."""
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    rstd = torch.rsqrt(x.float().pow(2).mean(dims, keepdim=True) + epsilon)
    return (x.float() * rstd).to(x.dtype) * gamma, rstd


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                     epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rms_norm(x1 + x2), rstd, x1 + x2)."""
    x = x1 + x2
    y, rstd = npu_rms_norm(x, gamma, epsilon)
    return y, rstd, x


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """silu(a) * b of x's two halves a, b along ``dim``."""
    a, b = x.chunk(2, dim=dim)
    return F.silu(a) * b


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
                   rotary_mode: str = "half") -> torch.Tensor:
    """x * r1 + rotate(x) * r2, r1 and r2 broadcast over x [B, S, N, D]: rotate-half ("half": (-x2, x1) of the
    halves) or pairwise ("interleave": (-x_odd, x_even) in each pair)."""
    if x.dim() != 4:
        raise RuntimeError(f"npu_rotary_mul: x must be 4-dimensional, not {x.dim()}")
    if rotary_mode == "half":
        first, second = x.chunk(2, dim=-1)
        rotated = torch.cat([-second, first], dim=-1)
    elif rotary_mode == "interleave":
        rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    else:
        raise RuntimeError(f"npu_rotary_mul: rotary_mode {rotary_mode!r}")
    return x * r1 + rotated * r2


def npu_fused_infer_attention_score(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, atten_mask: torch.Tensor | None = None,
        num_heads: int = 1, num_key_value_heads: int = 0, scale: float = 1.0, input_layout: str = "BSH",
        sparse_mode: int = 0, **unsupported: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * q k^T, keys where atten_mask is True hidden) v, for the BNSD layout without a block table;
    returns (attention_out, a zero softmax_lse as without softmax_lse_flag)."""
    if unsupported:
        raise NotImplementedError(f"the stand-in has no {sorted(unsupported)}")
    if input_layout != "BNSD" or sparse_mode != 0:
        raise NotImplementedError(f"the stand-in has input_layout BNSD with sparse_mode 0, not {input_layout} "
                                  f"with {sparse_mode}")
    if query.dtype not in (torch.float16, torch.bfloat16):  # as the hardware: no float32
        raise RuntimeError(f"npu_fused_infer_attention_score: query dtype {query.dtype} is not supported")
    if atten_mask is not None and atten_mask.dtype not in (torch.bool, torch.int8, torch.uint8):
        raise RuntimeError(f"npu_fused_infer_attention_score: atten_mask dtype {atten_mask.dtype}")
    kv_heads = num_key_value_heads or num_heads
    if query.shape[1] != num_heads or key.shape[1] != kv_heads or num_heads % kv_heads:
        raise RuntimeError("npu_fused_infer_attention_score: head counts do not match the shapes")
    group = num_heads // kv_heads
    key, value = (t.repeat_interleave(group, dim=1) for t in (key, value))
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale
    if atten_mask is not None:
        scores = scores.masked_fill(atten_mask.bool(), float("-inf"))
    out = (scores.softmax(-1) @ value.float()).to(query.dtype)
    return out, torch.zeros(1, dtype=torch.float32, device=query.device)


# hccl: gloo over the values of the npu tensors.

class _StandInHccl(dist.ProcessGroup):
    """c10d takes a Python backend that is a whole process group (a c10d Backend cannot be subclassed in Python):
    this one carries the CPU tensors of "cpu:gloo,npu:hccl" to gloo too."""

    def __init__(self, store: Any, rank: int, size: int, timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("standin-hccl", store), rank, size, timeout)

    def getBackendName(self) -> str:
        return "hccl"

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._gloo.allreduce([_values(t) for t in tensors], opts)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any) -> Any:
        return self._gloo.allgather([[_values(t) for t in ts] for ts in outputs], [_values(t) for t in inputs], opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:
        return self._gloo.broadcast([_values(t) for t in tensors], opts)

    def barrier(self, opts: Any = None) -> Any:
        return self._gloo.barrier(opts) if opts is not None else self._gloo.barrier()


def _values(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values for gloo; an npu tensor must be on this rank's device, as HCCL requires."""
    if not isinstance(t, NpuTensor):
        return t
    if t.device.index != _current:
        raise RuntimeError(f"hccl: a tensor on {t.device} in the rank of npu:{_current}")
    return t.cpu_values


def _create_hccl(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> _StandInHccl:
    return _StandInHccl(store, rank, size, timeout)


dist.Backend.register_backend("hccl", _create_hccl, devices=["npu"])
