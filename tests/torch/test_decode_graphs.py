"""Decode steps replayed from TorchScript traces: the same kernels as eager steps, so the same tokens and logprobs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pocketllm.errors import ConfigError
from pocketllm_torch.linear import kernel_key, uses_int4
from tests.torch.torch_testkit import add, greedy, make_engine, prompt, tiny_model


def decode_all(engine, requests) -> dict[str, list[tuple[int, float, list[int]]]]:
    """Each request's (token, logprob, top alternatives) at every step."""
    for request_id, (ids, params) in requests.items():
        add(engine, request_id, ids, params)
    out: dict[str, list] = {request_id: [] for request_id in requests}
    while engine.has_unfinished():
        for delta in engine.step():
            lp = delta.logprobs[0]
            out[delta.request_id].append((delta.new_token_ids[0], lp.logprob, [t.token_id for t in lp.top]))
    assert engine.block_manager.num_used_blocks == 0
    return out


@pytest.mark.skipif(not uses_int4(torch.device("cpu"), torch.bfloat16), reason="no int4 CPU kernel in this torch")
def test_traced_decode_steps_match_eager_ones() -> None:
    _, checkpoint = tiny_model()
    checkpoint = dataclasses.replace(checkpoint, quantization="Q4_1")  # 4-bit kernels, which trace
    # Staggered prompts and lengths: the batch shrinks from 4 sequences to 1, contexts cross 4-token blocks.
    requests = {f"r{i}": (prompt(3 + 7 * i, offset=i), greedy(6 + 5 * i, logprobs=2)) for i in range(4)}
    results, engines = {}, {}
    for on in (False, True):
        engines[on] = make_engine(checkpoint, device="cpu", dtype="bfloat16",
                                  backend_options={"decode_graphs": on, "block_size": 4})
        results[on] = decode_all(engines[on], requests)
    assert results[True] == results[False]
    assert engines[False].runner.decode_graphs is None
    traces = engines[True].runner.decode_graphs.traces
    assert traces[kernel_key(1)] is not None and traces[kernel_key(4)] is not None


def test_untraceable_kernels_fall_back_to_eager_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    from pocketllm_torch import linear

    monkeypatch.setattr(linear, "SMALL_WEIGHT_ELEMENTS", 0)  # every fp32 matrix in oneDNN's layout, as in real models
    _, checkpoint = tiny_model()
    requests = {f"r{i}": (prompt(5 + i, offset=i), greedy(8, logprobs=2)) for i in range(2)}
    eager = decode_all(make_engine(checkpoint, device="cpu", backend_options={"decode_graphs": False}), requests)
    engine = make_engine(checkpoint, device="cpu", backend_options={"decode_graphs": True})
    assert decode_all(engine, requests) == eager
    assert engine.runner.decode_graphs.traces == {kernel_key(2): None}  # fp32: oneDNN's prepacked linear


def test_decode_graphs_option_is_a_bool() -> None:
    _, checkpoint = tiny_model()
    with pytest.raises(ConfigError, match="decode_graphs"):
        make_engine(checkpoint, backend_options={"decode_graphs": "yes"})
