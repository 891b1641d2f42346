"""Tensor-parallel conformance: a backend that declares ``Capabilities.tensor_parallel`` runs the kit's
checkpoints at ``tensor_parallel_size`` 2 (through the library, which starts rank 1 as a child process) and
must generate what it does alone, stream, abort, and leave no rank running after shutdown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest

from pocketllm.sampling_params import SamplingParams
from pocketllm.tensor_parallel import LocalRanks
from pocketllm.testing.protocol import GREEDY, PROMPTS, KitBase

TP_CHECKPOINTS = ("llama", "qwen3", "llama-gguf", "qwen3_5")


class TensorParallelConformance(KitBase):
    """Subclass with ``backend = "name"`` (and ``engine_kwargs``); ``checkpoints`` narrows TP_CHECKPOINTS."""

    tensor_parallel_size: ClassVar[int] = 2
    checkpoints: ClassVar[tuple[str, ...]] = TP_CHECKPOINTS

    @pytest.fixture(scope="class", params=TP_CHECKPOINTS)
    @classmethod
    def kind(cls, request: pytest.FixtureRequest) -> str:
        if request.param not in cls.checkpoints:
            pytest.skip(f"{cls.backend} runs tensor parallelism on {', '.join(cls.checkpoints)}")
        return request.param

    @pytest.fixture(scope="class")
    @classmethod
    def model_path(cls, kind: str, pocketllm_kit_checkpoint: Any) -> Path:
        return pocketllm_kit_checkpoint(kind)

    @pytest.fixture(scope="class")
    @classmethod
    def alone(cls, model_path: Path) -> list[list[int]]:
        llm = cls.make_llm(model_path)
        try:
            return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
        finally:
            llm.shutdown()

    @pytest.fixture(scope="class")
    @classmethod
    def llm(cls, model_path: Path) -> Iterator[Any]:
        llm = cls.make_llm(model_path, tensor_parallel_size=cls.tensor_parallel_size)
        yield llm
        llm.shutdown()
        # Ranks the library started are held until their group is closed, which waits for each (or kills it).
        assert not LocalRanks.active, "shutdown left the tensor-parallel ranks it started running"

    def test_greedy_ids_equal_one_rank(self, llm: Any, alone: list[list[int]]) -> None:
        assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)] == alone

    def test_stream_matches(self, llm: Any, alone: list[list[int]]) -> None:
        assert [t for e in llm.generate_stream(PROMPTS[1], GREEDY) for t in e.token_ids] == alone[1]

    def test_abort_frees_the_blocks(self, llm: Any, alone: list[list[int]]) -> None:
        stream = llm.generate_stream(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True))
        next(iter(stream))
        stream.close()
        self.wait_idle(llm)
        assert [out.outputs[0].token_ids for out in llm.generate(PROMPTS[:2], GREEDY)] == alone[:2]
