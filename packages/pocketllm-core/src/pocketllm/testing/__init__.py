"""The conformance kit: what a backend's own tests subclass to prove it keeps the contract.

Two classes (and more for tensor parallelism and steps of several tokens), each run by subclassing it in a test
module of the backend's package::

    from pocketllm.testing import ModelConformance, ProtocolConformance

    class TestMyBackendProtocol(ProtocolConformance):     # any backend
        backend = "mybackend"

    class TestMyBackendModels(ModelConformance):          # a backend that runs models
        backend = "mybackend"
        engine_kwargs = {"dtype": "float32"}

    class TestMyBackendTP(TensorParallelConformance):     # one that declares tensor_parallel
        backend = "mybackend"

    class TestMyBackendSteps(MultiTokenConformance):      # one whose steps may give several tokens
        backend = "mybackend"
        multi_token_kwargs = {"my_mode": True}

    class TestMyBackendSpeculative(SpeculativeConformance):  # one that lists a speculative method
        backend = "mybackend"
        checkpoint = "qwen3-cyclic"
        multi_token_kwargs = {"speculative_method": "ngram", "num_speculative_tokens": 3}

The kit writes its own tiny checkpoints (``checkpoints.py``) and ships transformers' outputs on them
(``data/references.json``); its pytest fixtures come with pocketllm-core through the ``pytest11`` entry point.

For tests of the core and of servers built on it: ``GatedBackend`` (``gates.py``) wraps a backend so that its steps
wait on a gate the test holds, releases or fails; ``engine_driver`` (``hooks.py``) reaches the driver behind an
``LLM``, which applications never need.
"""

from __future__ import annotations

try:
    import pytest  # noqa: F401  (the conformance classes are pytest test classes)
except ImportError as e:
    raise ImportError("pocketllm.testing is the conformance kit, and needs pytest: "
                      "pip install 'pocketllm-core[testing]'") from e

from pocketllm.testing.checkpoints import KIT_CHECKPOINTS, make_tiny_gguf, make_tiny_llama, make_tiny_qwen3
from pocketllm.testing.gates import GatedBackend, StepGate
from pocketllm.testing.hooks import engine_driver
from pocketllm.testing.model import ModelConformance
from pocketllm.testing.multi_token import MultiTokenConformance
from pocketllm.testing.protocol import ProtocolConformance
from pocketllm.testing.speculative import SpeculativeConformance
from pocketllm.testing.tensor_parallel import TensorParallelConformance


class BackendConformance(ProtocolConformance, ModelConformance):
    """Both classes at once, for a backend that runs models (and what contract 1's kit was called)."""


__all__ = ["KIT_CHECKPOINTS", "BackendConformance", "GatedBackend", "ModelConformance", "MultiTokenConformance",
           "ProtocolConformance", "SpeculativeConformance", "StepGate", "TensorParallelConformance", "engine_driver",
           "make_tiny_gguf", "make_tiny_llama", "make_tiny_qwen3"]
