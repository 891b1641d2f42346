"""pocketllm-cpp's mixture-of-experts block against transformers' Qwen3.5 MoE block and a float64 reference, on
every ISA this CPU has: float and quantized experts, with and without renormalised top-k weights and a shared
expert; a token's result the same bits alone and in any batch; bad shapes a ValueError."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest

kernels = pytest.importorskip("pocketllm_cpp.kernels")
torch = pytest.importorskip("torch")

from pocketllm.checkpoint.tensor import CheckpointTensor  # noqa: E402
from tests.cpp.weights import random_weight, reference_activations  # noqa: E402

ISAS = kernels.available_isas().split()
HIDDEN, FF, SHARED_FF, EXPERTS, TOP_K = 256, 256, 512, 8, 3  # 256: one Q4_K super-block per row


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest):
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa("auto")


@dataclass(frozen=True)
class Tensor:
    moe: kernels.Tensor  # as moe_forward takes it
    values: np.ndarray  # its exact values, float64


@dataclass(frozen=True)
class Block:
    router: Tensor  # [experts, hidden]
    gate: Tensor  # [experts, ff, hidden]
    up: Tensor
    down: Tensor  # [experts, hidden, ff]
    shared_gate: Tensor  # [shared_ff, hidden]
    shared_up: Tensor
    shared_down: Tensor  # [hidden, shared_ff]
    shared_expert_gate: Tensor  # [1, hidden]


def _block(expert_type: str, seed: int = 0) -> Block:
    rng = np.random.default_rng(seed)

    def float32(shape: tuple[int, ...]) -> Tensor:  # the router and the sigmoid gate, as GGUF files keep them
        w = rng.standard_normal(shape).astype(np.float32)
        return Tensor(kernels.Tensor(w.view(np.uint8).reshape(-1), "F32", list(shape)), w.astype(np.float64))

    def stored(shape: tuple[int, ...], seed: int) -> Tensor:
        # A stacked tensor's bytes are its experts' matrices in turn: one matrix of experts * rows rows.
        raw, w = random_weight(expert_type, int(np.prod(shape[:-1])), shape[-1], seed=seed)
        return Tensor(kernels.Tensor(raw, expert_type, list(shape)), w.reshape(shape))

    return Block(router=float32((EXPERTS, HIDDEN)), gate=stored((EXPERTS, FF, HIDDEN), seed + 1),
                 up=stored((EXPERTS, FF, HIDDEN), seed + 2), down=stored((EXPERTS, HIDDEN, FF), seed + 3),
                 shared_gate=stored((SHARED_FF, HIDDEN), seed + 4), shared_up=stored((SHARED_FF, HIDDEN), seed + 5),
                 shared_down=stored((HIDDEN, SHARED_FF), seed + 6), shared_expert_gate=float32((1, HIDDEN)))


def _run(b: Block, x: np.ndarray, top_k: int = TOP_K, norm_topk_prob: bool = True, shared: bool = True,
         exact: bool = False) -> np.ndarray:
    return kernels.moe_forward(
        x, b.router.moe, b.gate.moe, b.up.moe, b.down.moe, top_k=top_k, norm_topk_prob=norm_topk_prob,
        shared_gate=b.shared_gate.moe if shared else None, shared_up=b.shared_up.moe if shared else None,
        shared_down=b.shared_down.moe if shared else None,
        shared_expert_gate=b.shared_expert_gate.moe if shared else None, exact=exact)


def _reference(b: Block, x: np.ndarray, norm_topk_prob: bool = True, shared: bool = True,
               quantized: bool = False) -> np.ndarray:
    """The block in float64; `quantized`: each input of a quantized weight rounded to 8-bit blocks first, as the
    integer kernels take it."""

    def rounded(a: np.ndarray) -> np.ndarray:
        return reference_activations(a.astype(np.float32)) if quantized else a.astype(np.float64)

    def swiglu(a: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
        g, u = rounded(a) @ gate.T, rounded(a) @ up.T
        return rounded(g / (1 + np.exp(-g)) * u) @ down.T

    logits = x.astype(np.float64) @ b.router.values.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :TOP_K]
    weights = np.take_along_axis(probs, top, -1)
    if norm_topk_prob:
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros(x.shape, np.float64)
    for t in range(len(x)):
        for e, weight in zip(top[t], weights[t], strict=True):
            out[t] += weight * swiglu(x[t:t + 1], b.gate.values[e], b.up.values[e], b.down.values[e])[0]
    if shared:
        scale = 1 / (1 + np.exp(-(x.astype(np.float64) @ b.shared_expert_gate.values.T)))
        out += scale * swiglu(x, b.shared_gate.values, b.shared_up.values, b.shared_down.values)
    return out


def _inputs(n: int, seed: int = 1) -> np.ndarray:
    # Small enough that the random weights' SwiGLU stays out of saturation.
    return (np.random.default_rng(seed).standard_normal((n, HIDDEN)) / 16).astype(np.float32)


def _assert_close(ours: np.ndarray, expected: np.ndarray, tolerance: float) -> None:
    assert ours.shape == expected.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, expected, rtol=0, atol=tolerance * np.abs(expected).max())


def _transformers_block(block: Block) -> torch.nn.Module:
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    config = Qwen3_5MoeTextConfig(hidden_size=HIDDEN, moe_intermediate_size=FF,
                                  shared_expert_intermediate_size=SHARED_FF, num_experts=EXPERTS,
                                  num_experts_per_tok=TOP_K)
    module = Qwen3_5MoeSparseMoeBlock(config).eval()

    def value(t: Tensor) -> torch.Tensor:
        return torch.from_numpy(t.values.astype(np.float32))

    with torch.no_grad():
        module.gate.weight.copy_(value(block.router))
        module.experts.gate_up_proj.copy_(torch.cat([value(block.gate), value(block.up)], dim=1))
        module.experts.down_proj.copy_(value(block.down))
        module.shared_expert.gate_proj.weight.copy_(value(block.shared_gate))
        module.shared_expert.up_proj.weight.copy_(value(block.shared_up))
        module.shared_expert.down_proj.weight.copy_(value(block.shared_down))
        module.shared_expert_gate.weight.copy_(value(block.shared_expert_gate))
    return module


def test_float32_experts_match_transformers(isa: str) -> None:
    block, x = _block("F32"), _inputs(9)
    with torch.no_grad():
        expected = _transformers_block(block)(torch.from_numpy(x)[None]).numpy()[0]
    _assert_close(_run(block, x), expected, 1e-4)
    _assert_close(_reference(block, x).astype(np.float32), expected, 1e-5)  # the reference the other tests use


@pytest.mark.parametrize("shared", [True, False])
def test_without_renormalised_weights_or_a_shared_expert(isa: str, shared: bool) -> None:
    block, x = _block("F32", seed=2), _inputs(5, seed=3)
    _assert_close(_run(block, x, norm_topk_prob=False, shared=shared),
                  _reference(block, x, norm_topk_prob=False, shared=shared), 1e-4)
    _assert_close(_run(block, x, shared=shared), _reference(block, x, shared=shared), 1e-4)


@pytest.mark.parametrize("storage_type", ["F16", "BF16", "Q8_0", "Q4_K", "Q6_K"])
def test_experts_read_in_their_storage_type(isa: str, storage_type: str) -> None:
    """Against the dequantized weights: with 8-bit activations as the kernels round them, and exact (float32
    activations) mode."""
    block, x = _block(storage_type, seed=4), _inputs(6, seed=5)
    _assert_close(_run(block, x), _reference(block, x, quantized=storage_type.startswith("Q")), 1e-4)
    _assert_close(_run(block, x, exact=True), _reference(block, x), 1e-4)


@pytest.mark.parametrize("storage_type", ["F32", "Q8_0", "Q4_K"])
def test_a_token_is_the_same_bits_alone_and_in_any_batch(isa: str, storage_type: str) -> None:
    """Batched, each expert multiplies several rows (the kernels' batched tiles) and a token's rows sit among
    others': a token's output must not depend on what else is in the call."""
    block, x = _block(storage_type, seed=6), _inputs(21, seed=7)
    alone = np.vstack([_run(block, x[i:i + 1]) for i in range(len(x))])
    for n in (2, 5, 21):
        np.testing.assert_array_equal(_run(block, x[:n]), alone[:n])
    shuffled = np.random.default_rng(8).permutation(len(x))
    np.testing.assert_array_equal(_run(block, x[shuffled]), alone[shuffled])


@pytest.mark.parametrize("storage_type", ["Q4_K", "Q6_K"])
def test_experts_over_many_rows_run_in_blocks_with_the_same_bits(isa: str, storage_type: str) -> None:
    """700 tokens send about 260 rows to each expert: some past the 256 rows a product takes at once (matmul.cpp's
    kRowBlock), some not, in one grouped product. Each token's output must be what it is in batches of 50."""
    block, x = _block(storage_type, seed=9), _inputs(700, seed=10)
    pieces = np.vstack([_run(block, x[r:r + 50]) for r in range(0, len(x), 50)])
    np.testing.assert_array_equal(_run(block, x), pieces)


def test_ties_go_to_the_lower_expert_index(isa: str) -> None:
    """A router that cannot tell the experts apart: every probability equal, the first top_k experts chosen."""
    block = _block("F32", seed=14)
    zero = np.zeros((EXPERTS, HIDDEN), np.float32)
    tied = replace(block, router=Tensor(kernels.Tensor(zero.view(np.uint8).reshape(-1), "F32", [EXPERTS, HIDDEN]),
                                        zero.astype(np.float64)))
    x = _inputs(3, seed=15)
    _assert_close(_run(tied, x), _reference(tied, x), 1e-4)  # the reference's stable sort keeps the lower index


def test_isas_agree() -> None:
    block, x = _block("Q4_K", seed=9), _inputs(4, seed=10)
    results = []
    for isa in ISAS:
        kernels.set_isa(isa)
        results.append(_run(block, x))
    kernels.set_isa("auto")
    for ours in results:
        _assert_close(ours, results[0], 1e-5)


def test_checkpoint_tensors_in_place() -> None:
    """tensor_of: a stacked checkpoint tensor's bytes as they are, no copy."""
    gate = _block("Q8_0", seed=11).gate.moe
    tensor = CheckpointTensor(name="model.layers.0.mlp.experts.gate_proj", file_name="blk.0.ffn_gate_exps.weight",
                              shape=tuple(gate.shape), storage_type="Q8_0", path=None, offset=0,
                              nbytes=gate.data.size, _buffer=gate.data)
    converted = kernels.tensor_of(tensor)
    assert converted.shape == gate.shape and converted.storage_type == "Q8_0"
    assert np.shares_memory(converted.data, gate.data)


@pytest.mark.parametrize(("name", "storage_type", "shape", "message"), [
    ("gate", "F32", [EXPERTS, FF + 32, HIDDEN], r"moe gate: weight has \d+ bytes"),
    ("up", "F32", [EXPERTS, FF // 2, 2 * HIDDEN], r"expert 0 up has shape \[128, 512\], expected \[256, 256\]"),
    ("down", "F32", [EXPERTS // 2, 2 * HIDDEN, FF], r"has 4 down windows for a router of 8 experts"),
    ("down", "F32", [EXPERTS, HIDDEN], r"down has 2 dimensions, expected 3"),
    ("router", "F32", [2 * EXPERTS, HIDDEN // 2], r"router has shape \[16, 128\], expected \[16, 256\]"),
    ("gate", "F32", [2**40, FF, HIDDEN], r"moe gate: weight has \d+ bytes"),  # an expert count past the bytes
    ("gate", "F32", [2**40, 2**40, HIDDEN], r"gate has 1099511627776 experts of 1099511627776 rows"),
    ("gate", "F32", [-EXPERTS, -FF, HIDDEN], r"gate has -8 experts"),
    ("gate", "Q2_K", [EXPERTS, FF, HIDDEN], r"storage type"),
    ("shared_expert_gate", "F32", [2, HIDDEN // 2], r"sigmoid gate has shape \[2, 128\], expected \[1, 256\]"),
])
def test_bad_shapes_raise_value_error(name: str, storage_type: str, shape: list[int], message: str) -> None:
    block = _block("F32", seed=12)
    bad = replace(getattr(block, name), moe=kernels.Tensor(getattr(block, name).moe.data, storage_type, shape))
    with pytest.raises(ValueError, match=message):
        _run(replace(block, **{name: bad}), _inputs(2))


def test_bad_arguments_raise_value_error() -> None:
    block, x = _block("F32", seed=13), _inputs(2)
    for top_k in (0, EXPERTS + 1):
        with pytest.raises(ValueError, match=rf"top_k {top_k} is not in 1\.\.8"):
            _run(block, x, top_k=top_k)
    with pytest.raises(ValueError, match="shared_gate, shared_up, shared_down and shared_expert_gate, or none"):
        kernels.moe_forward(x, block.router.moe, block.gate.moe, block.up.moe, block.down.moe, top_k=TOP_K,
                            shared_gate=block.shared_gate.moe)
    with pytest.raises(ValueError, match=r"router has shape \[8, 256\], expected \[8, 128\]"):
        _run(block, np.zeros((1, HIDDEN // 2), np.float32))
    assert _run(block, np.zeros((0, HIDDEN), np.float32)).shape == (0, HIDDEN)
    assert np.isnan(_run(block, np.full((1, HIDDEN), np.nan, np.float32))).all()  # a diverged row routes, no crash
