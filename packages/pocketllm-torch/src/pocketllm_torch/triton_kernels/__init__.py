"""Triton kernels of the torch backend, for GPUs: paged attention over the block table, RMSNorm with the residual
add, SwiGLU and rotary embeddings. Optional: CPU installs never import triton, and ``available()`` says whether
these can run (triton importable). Each kernel has the torch backend's own op as its reference; the tests run both
on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set before this package is imported) and on a GPU where
there is one (``bench/gpu/check.sh``).
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """Whether triton is installed (the kernels compile for a GPU, or run under its interpreter)."""
    return importlib.util.find_spec("triton") is not None
