"""PocketLLM's native C++ engine, in progress: so far its CPU kernels (``pocketllm_cpp.kernels``).

It registers no backend yet: the engine (scheduler, KV cache, sampler) comes next, built on these kernels.
"""

from __future__ import annotations

__version__ = "0.1.0"
