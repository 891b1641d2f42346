"""The conformance kit on the torch backend, in float32: the configuration whose results do not depend on what
else is in the batch, which the kit's batch-against-alone checks need (bf16 kernels vary with the row count)."""

from __future__ import annotations

from typing import ClassVar

import pytest

from pocketllm.testing import BackendConformance

pytest.importorskip("pocketllm_torch")


class TestTorchConformance(BackendConformance):  # ProtocolConformance and ModelConformance
    backend = "torch"
    engine_kwargs: ClassVar[dict[str, object]] = {"dtype": "float32"}
