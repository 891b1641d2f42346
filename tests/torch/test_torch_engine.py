"""TorchEngine's contract: refused options, request validation, finish reasons, logprobs, seeds, dtypes."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from pocketllm.errors import ConfigError, PromptTooLongError, UnsupportedOptionError
from pocketllm.sampling_params import SamplingParams
from tests.torch.torch_testkit import DEVICE, EOS, add, greedy, make_engine, prompt, run_to_completion, tiny_model

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers")


@pytest.fixture(scope="module")
def model_and_checkpoint():
    return tiny_model("llama", tie=False, seed=2)


@pytest.fixture(scope="module")
def checkpoint(model_and_checkpoint):
    return model_and_checkpoint[1]


@pytest.mark.parametrize(("args", "option"), [
    ({"backend_options": {"no_such_knob": 1}}, "backend_options.no_such_knob"),
    ({"speculative_method": "mtp", "num_speculative_tokens": 2}, "speculative_method"),  # no head in a Llama
    ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype"),
    pytest.param({"dtype": "float16"}, "dtype", marks=pytest.mark.skipif(DEVICE != "cpu", reason="CUDA has fp16")),
    ({"device": "npu"}, "device"),
])
def test_unsupported_options_are_refused(checkpoint, args: dict[str, Any], option: str) -> None:
    with pytest.raises(UnsupportedOptionError) as err:
        make_engine(checkpoint, **args)
    assert (err.value.option, err.value.backend) == (option, "torch")


def test_too_few_kv_blocks_for_one_sequence_is_refused(checkpoint) -> None:
    with pytest.raises(ConfigError):
        make_engine(checkpoint, max_model_len=128, backend_options={"block_size": 16, "num_kv_blocks": 7})


def test_request_validation(checkpoint) -> None:
    """What the core refuses before the engine sees a request (see pocketllm.backend.Engine.add_request)."""
    engine = make_engine(checkpoint, max_model_len=32)
    with pytest.raises(PromptTooLongError):
        add(engine, "long", prompt(32), greedy())
    with pytest.raises(ConfigError):
        add(engine, "empty", [], greedy())
    with pytest.raises(ConfigError):
        add(engine, "oov", [10_000], greedy())
    with pytest.raises(ConfigError):
        add(engine, "bias", prompt(3), SamplingParams(logit_bias={10_000: 1.0}))
    add(engine, "ok", prompt(3), greedy())
    assert engine.stats().num_waiting == 1


def finish(engine, request_id: str, ids: list[int], params: SamplingParams):
    add(engine, request_id, ids, params)
    deltas = []
    while engine.has_unfinished():
        deltas += [d for d in engine.step() if d.request_id == request_id]
    assert all(d.finish_reason is None for d in deltas[:-1])
    return [t for d in deltas for t in d.new_token_ids], deltas[-1]


def test_finish_reasons(checkpoint) -> None:
    engine = make_engine(checkpoint, max_model_len=40)
    ids = prompt(10)
    tokens, last = finish(engine, "a", ids, greedy(8))
    assert (len(tokens), last.finish_reason, last.stop_token_id) == (8, "length", None)

    stop = tokens[3]
    cut, last = finish(engine, "b", ids, greedy(8, stop_token_ids=[stop]))
    assert cut == tokens[:tokens.index(stop) + 1] and (last.finish_reason, last.stop_token_id) == ("stop", stop)

    late, last = finish(engine, "c", ids, greedy(8, stop_token_ids=[stop], min_tokens=tokens.index(stop) + 2))
    assert stop not in late[:tokens.index(stop) + 2] and late[:tokens.index(stop)] == tokens[:tokens.index(stop)]

    to_the_end, last = finish(engine, "d", ids, greedy(None))
    assert (len(to_the_end), last.finish_reason) == (30, "length")  # max_model_len

    eos_forced, last = finish(engine, "e", ids, SamplingParams(temperature=0.0, logit_bias={EOS: 100.0}))
    assert (eos_forced, last.finish_reason, last.stop_token_id) == ([EOS], "stop", None)
    ignored, last = finish(engine, "f", ids, greedy(3, logit_bias={EOS: 100.0}))
    assert (ignored, last.finish_reason) == ([EOS] * 3, "length")
    assert engine.stats().num_kv_blocks_used == 0


def test_logprobs_match_transformers(model_and_checkpoint) -> None:
    hf, checkpoint = model_and_checkpoint
    ids = prompt(12)
    tokens, last = finish(make_engine(checkpoint), "a", ids, greedy(1, logprobs=5))
    [lp] = last.logprobs
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
    assert (lp.token_id, lp.rank) == (tokens[0], 1)
    assert lp.logprob == pytest.approx(reference.max().item(), abs=1e-4)
    assert [t.token_id for t in lp.top] == reference.topk(5).indices.tolist()


def test_seeded_sampling_is_reproducible_across_batches(checkpoint) -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=1234, ignore_eos=True)
    alone = run_to_completion(make_engine(checkpoint), {"s": (prompt(9), seeded)})["s"]
    crowd = {f"n{i}": (prompt(5 + i, offset=i), SamplingParams(max_tokens=12 + i, ignore_eos=True)) for i in range(3)}
    batched = run_to_completion(make_engine(checkpoint, seed=7), crowd | {"s": (prompt(9), seeded)})["s"]
    assert alone == batched
    other = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=4321, ignore_eos=True)
    assert run_to_completion(make_engine(checkpoint), {"s": (prompt(9), other)})["s"] != alone


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32"])
def test_bfloat16_on_cpu_stays_close_to_float32(checkpoint, kv_cache_dtype: str) -> None:
    requests = {str(i): (prompt(6 + 7 * i, offset=i), greedy(8)) for i in range(3)}
    full = run_to_completion(make_engine(checkpoint), requests)
    engine = make_engine(checkpoint, dtype="bfloat16", kv_cache_dtype=kv_cache_dtype)
    half = run_to_completion(engine, requests)
    # bf16 rounding may flip a near-tie late on; the first tokens must agree.
    assert all(half[rid][:2] == full[rid][:2] for rid in requests)
    assert engine.stats().num_kv_blocks_used == 0
