"""PocketLLM's native C++ backend ``cpp``: GGUF blocks used in place, its own scheduler, KV pool and sampler.

The engine is a C++ library (``include/``, ``src/``) behind the nanobind module ``_native``; ``backend.py`` is
what the core sees. It is young: correct (it passes both classes of the conformance kit) but not yet tuned.
"""

from __future__ import annotations

__version__ = "0.1.0"
