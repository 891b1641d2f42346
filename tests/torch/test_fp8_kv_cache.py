"""kv_cache_dtype="fp8" on the torch backend: keys and values stored as e4m3 (per-tensor scale 1, saturated at 448),
one byte each; attention reads them back as the same values the float32 path would compute with after that
rounding."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pocketllm_torch")

from pocketllm import LLM, SamplingParams  # noqa: E402
from pocketllm_torch.attention import FP8, FP8_MAX, KVCache, build_metadata, paged_attention, store_kv  # noqa: E402

BLOCK_SIZE = 16


@pytest.mark.parametrize("lengths", [[13, 1, 9], [1, 1]], ids=["prefill", "decode"])
def test_attention_over_an_fp8_cache_is_attention_over_its_rounded_values(lengths: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(lengths))
    starts = [5, 30, 0][:len(lengths)]
    tables = [[3, 1, 6], [2, 4, 7], [5]][:len(lengths)]
    caches = {dtype: KVCache(1, 8, BLOCK_SIZE, 2, 64, dtype, torch.device("cpu")) for dtype in (FP8, torch.float32)}
    q = torch.randn(sum(lengths), 4, 64, generator=gen)
    history = torch.randn(2, 2, 8 * BLOCK_SIZE, 64, generator=gen) * 300  # some past the format's range
    new = torch.randn(2, 2, sum(lengths), 64, generator=gen)
    _, meta = build_metadata(starts, lengths, tables, BLOCK_SIZE, torch.device("cpu"), torch.float32)
    def rounded(t: torch.Tensor) -> torch.Tensor:  # what an fp8 cache holds of t
        return t.clamp(-FP8_MAX, FP8_MAX).to(FP8).float()

    every_slot = torch.arange(8 * BLOCK_SIZE)
    outs = {}
    for dtype, cache in caches.items():
        cache.zero_new_blocks(tables)
        layer = cache.layers[0]
        store_kv(layer, every_slot, history if dtype == FP8 else rounded(history))
        outs[dtype] = paged_attention(q, new if dtype == FP8 else rounded(new), layer, meta, 0.125)
    assert caches[FP8].blocks.dtype == FP8 and caches[FP8].blocks.element_size() == 1
    torch.testing.assert_close(outs[FP8], outs[torch.float32], rtol=0, atol=0)


def test_an_engine_serves_with_an_fp8_cache(pocketllm_kit_checkpoint) -> None:
    """Twice the blocks of a bfloat16 cache in the same bytes; greedy output equal with the prefix cache on and
    off (the cached blocks are read as they were written)."""
    path = str(pocketllm_kit_checkpoint("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = [[5, 9, 13, 2, 40] * 8]
    outputs = []
    for caching in (False, True):
        llm = LLM(path, backend="torch", dtype="float32", kv_cache_dtype="fp8", enable_prefix_caching=caching,
                  max_model_len=128)
        try:
            runner = llm.backend_engine.runner  # type: ignore[attr-defined]
            assert runner.kv_cache.blocks.dtype == FP8
            outputs += [llm.generate(prompt, params)[0].outputs[0].token_ids for _ in range(2)]
        finally:
            llm.shutdown()
    assert len(set(map(tuple, outputs))) == 1
