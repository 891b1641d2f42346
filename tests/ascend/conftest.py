"""The Ascend backend's tests run on the stand-in NPU (``standin/torch_npu``): its directory goes on the path of this
process and, through PYTHONPATH, of the tensor-parallel ranks it starts, while these tests run (afterwards torch_npu
is not found, as on a machine without it). Modules here import torch_npu, and what imports it,
inside their tests: collection comes before this fixture."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

STANDIN = str(Path(__file__).parent / "standin")


@pytest.fixture(scope="package", autouse=True)
def torch_npu() -> Iterator[ModuleType]:
    """The stand-in torch_npu, imported (which registers the npu device, once for the process)."""
    pytest.importorskip("pocketllm_ascend")
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(STANDIN)
        patch.setenv("PYTHONPATH", os.pathsep.join(p for p in (STANDIN, os.environ.get("PYTHONPATH")) if p))
        yield importlib.import_module("torch_npu")
    # The npu device stays registered (PyTorch allows one renaming per process), but the module goes: later tests
    # find no torch_npu, as on a machine without it.
    sys.modules.pop("torch_npu", None)
