"""The torch backend's Triton kernels against its own torch ops (the reference path), on small fp32 shapes: on a GPU
where there is one, else on CPU under Triton's interpreter (TRITON_INTERPRET=1, which must be set before triton
compiles anything: this module sets it when no GPU is visible). The interpreter has no bf16 and runs programs one
after another; what it cannot run (bf16 and fp8 caches, speed) runs only on a GPU (bench/gpu/check.sh)."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("pocketllm_torch")
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from pocketllm_torch.attention import KVCache, build_metadata  # noqa: E402
from pocketllm_torch.attention import paged_attention as reference_attention  # noqa: E402
from pocketllm_torch.models.llama import RMSNorm, apply_rope_  # noqa: E402
from pocketllm_torch.models.qwen3_5 import rotate_partial  # noqa: E402
from pocketllm_torch.triton_kernels import attention, elementwise, rotary  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 16


@pytest.mark.parametrize(("group", "head_dim", "kv_heads"), [(1, 64, 2), (3, 128, 1), (8, 256, 1), (2, 80, 2)])
def test_paged_attention_equals_the_torch_path(group: int, head_dim: int, kv_heads: int) -> None:
    """Several sequences at once, each a prefill chunk after a cached context or a single decoded token, of odd
    lengths, their blocks handed out of order: the torch path's output for every token."""
    gen = torch.Generator().manual_seed(group * head_dim)
    heads = group * kv_heads
    starts, lengths = [0, 21, 37, 5], [13, 1, 9, 1]  # sequence b computes positions starts[b] .. + lengths[b]
    needed = [-(-(s + n) // BLOCK_SIZE) for s, n in zip(starts, lengths, strict=True)]
    order = torch.randperm(sum(needed), generator=gen) + 1  # block 0 is the null block
    tables, at = [], 0
    for count in needed:
        tables.append(order[at:at + count].tolist())
        at += count
    cache = KVCache(1, sum(needed) + 1, BLOCK_SIZE, kv_heads, head_dim, torch.float32, DEVICE)
    cache.zero_new_blocks(tables)
    layer = cache.layers[0]
    for table, start in zip(tables, starts, strict=True):  # the cached context of each sequence
        for position in range(start):
            slot = table[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
            layer[:, :, slot] = torch.randn(2, kv_heads, head_dim, generator=gen).to(DEVICE)
    tokens = sum(lengths)
    q = torch.randn(tokens, heads, head_dim, generator=gen).to(DEVICE)
    new_kv = torch.randn(2, kv_heads, tokens, head_dim, generator=gen).to(DEVICE)
    positions, meta = build_metadata(starts, lengths, tables, BLOCK_SIZE, DEVICE, torch.float32)
    scale = head_dim ** -0.5
    expected = reference_attention(q, new_kv, layer, meta, scale)  # writes the new keys and values first
    token_seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(DEVICE)
    got = attention.paged_attention(q, layer, meta.context_blocks, token_seq, positions, BLOCK_SIZE, scale)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_paged_attention_applies_the_cache_scales() -> None:
    """An fp8 cache's per-tensor scales multiply what is read: values stored at 1/s read back as the originals."""
    gen = torch.Generator().manual_seed(5)
    cache = KVCache(1, 3, BLOCK_SIZE, 1, 64, torch.float32, DEVICE)
    cache.zero_new_blocks([[2, 1]])
    q = torch.randn(20, 2, 64, generator=gen).to(DEVICE)
    kv = torch.randn(2, 1, 20, 64, generator=gen).to(DEVICE)
    positions, meta = build_metadata([0], [20], [[2, 1]], BLOCK_SIZE, DEVICE, torch.float32)
    expected = reference_attention(q, kv, cache.layers[0], meta, 0.125)
    cache.layers[0][0] /= 4.0
    cache.layers[0][1] /= 0.5
    seq = torch.zeros(20, dtype=torch.int64, device=DEVICE)
    got = attention.paged_attention(q, cache.layers[0], meta.context_blocks, seq, positions, BLOCK_SIZE, 0.125,
                                    k_scale=4.0, v_scale=0.5)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("cols", [64, 200])
def test_rms_norm_equals_the_torch_path(with_delta: bool, cols: int) -> None:
    gen = torch.Generator().manual_seed(cols)
    x, delta = (torch.randn(7, cols, generator=gen).to(DEVICE) for _ in range(2))
    norm = RMSNorm(torch.randn(cols, generator=gen).to(DEVICE), 1e-6)
    expected = norm.add(x, delta) if with_delta else (x, norm(x))
    out, residual = elementwise.rms_norm(x, norm.weight, 1e-6, delta if with_delta else None)
    torch.testing.assert_close(residual, expected[0])
    torch.testing.assert_close(out, expected[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cols", [96, 1500])
def test_silu_mul_equals_the_torch_path(cols: int) -> None:
    gate_up = torch.randn(5, 2 * cols, generator=torch.Generator().manual_seed(cols)).to(DEVICE)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(elementwise.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False], ids=["llama pairs", "qwen3_5 halves"])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (256, 64), (128, 32)])
def test_rotary_equals_the_torch_path(head_dim: int, rotary_dim: int, interleaved: bool) -> None:
    """Full and partial rotary (Qwen3.5 rotates a quarter of each head), in both pairings of the torch models:
    Llama's interleaved pairs (apply_rope_) and Qwen3.5's halves (rotate_partial)."""
    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    positions = torch.tensor([3, 0, 17, 17, 40, 2])
    frequencies = 1e4 ** (-torch.arange(0, rotary_dim, 2).double() / rotary_dim)
    angles = (torch.arange(64).double()[:, None] * frequencies)[positions]  # [T, rotary_dim / 2]
    x = torch.randn(len(positions), 4, head_dim, generator=gen)
    cos, sin = angles.cos().float(), angles.sin().float()
    if interleaved:
        expected = x.clone()
        part = expected[..., :rotary_dim].clone()
        apply_rope_(part, torch.polar(torch.ones_like(angles), angles).to(torch.complex64).unsqueeze(1))
        expected[..., :rotary_dim] = part
    else:
        expected = rotate_partial(x, torch.cat([cos, cos], -1).unsqueeze(1), torch.cat([sin, sin], -1).unsqueeze(1))
    both = torch.cat([x, torch.zeros_like(x)], dim=1).to(DEVICE)  # x as a strided view, as q and k of a projection
    got = both[:, :4]
    rotary.rotary_(got, cos.to(DEVICE), sin.to(DEVICE), interleaved=interleaved)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
    assert not both[:, 4:].any()  # nothing past the view was written
    assert math.isclose(float(got[1].cpu().sub(x[1]).abs().max()), 0.0)  # position 0: no rotation


_GENERATE = """
import json, sys
from pocketllm import LLM, SamplingParams
llm = LLM(sys.argv[1], backend="torch", device=sys.argv[2], dtype="float32", max_model_len=128,
          prefill_chunk_size=16)
params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
outs = [o.outputs[0] for o in llm.generate([[5, 9, 13, 2, 40] * 5, [7, 60, 61]], params)]
print(json.dumps([[o.token_ids, [lp.logprob for lp in o.logprobs]] for o in outs]))
"""


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_5", "llama-gguf"])
def test_models_through_the_triton_kernels_generate_as_the_torch_ops(kind: str, pocketllm_kit_checkpoint) -> None:
    """A whole model on the torch backend with POCKETLLM_TORCH_KERNELS=triton (attention, norms, SwiGLU and rotary
    through the kernels, and a GGUF's Q4_0/Q4_1/Q8_0 matrices through the grouped GEMM; on CPU under the
    interpreter, else on the GPU): two sequences, one prefilled in chunks, then decoded together, give the greedy
    ids and logprobs of the torch ops on the same device."""
    import json
    import subprocess
    import sys

    path = str(pocketllm_kit_checkpoint(kind))
    runs = {}
    for kernels in ("torch", "triton"):
        env = os.environ | {"POCKETLLM_TORCH_KERNELS": kernels}
        done = subprocess.run([sys.executable, "-c", _GENERATE, path, DEVICE.type], env=env, capture_output=True,
                              text=True, timeout=600, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[kernels] = json.loads(done.stdout.strip().splitlines()[-1])
    for (ids, logprobs), (triton_ids, triton_logprobs) in zip(runs["torch"], runs["triton"], strict=True):
        assert triton_ids == ids
        np.testing.assert_allclose(triton_logprobs, logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("rows", "outs", "cols"), [(1, 5, 32), (3, 70, 96), (17, 64, 256), (70, 33, 160)])
def test_grouped_matmul_equals_the_dequantized_product(bits: int, rows: int, outs: int, cols: int) -> None:
    """GGUF's 4-bit (affine) and 8-bit groups multiplied by the Triton GEMM, which dequantizes a tile at a time:
    the product of the dequantized weights (the torch path's dense copy), for one row and many, partial tiles of
    rows, outputs and groups; and the layer's torch path (a decode trace's) dequantizes to the same weights."""
    from pocketllm_torch.linear import Int4Weight, Int8Weight, TritonGroupedLinear

    g = torch.Generator().manual_seed(rows * outs + cols)
    scale = torch.rand(outs, cols // 32, generator=g) / 64
    if bits == 4:
        codes = torch.randint(0, 16, (outs, cols), generator=g, dtype=torch.uint8)
        weight: Int4Weight | Int8Weight = Int4Weight(codes, scale, torch.randn(outs, cols // 32, generator=g) / 8)
    else:
        weight = Int8Weight(torch.randint(-128, 128, (outs, cols), generator=g, dtype=torch.int8), scale)
    x = torch.randn(rows, cols, generator=g)
    layer = TritonGroupedLinear.build(weight, None, DEVICE, torch.float32, None)
    dense = weight.dequantize()
    assert torch.equal(layer.dequantize().cpu(), dense)
    got = layer(x.to(DEVICE))
    torch.testing.assert_close(got.cpu(), x @ dense.T, rtol=1e-5, atol=1e-5)


def test_a_decode_trace_records_the_torch_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels forced, a TorchScript trace (the CPU's decode graphs) records the torch ops, which it can
    replay, rather than failing on a kernel launch."""
    from pocketllm_torch import triton_ops

    monkeypatch.setenv(triton_ops.KERNELS_ENV, "triton")
    norm = RMSNorm(torch.randn(64).to(DEVICE), 1e-6)
    x = torch.randn(3, 64).to(DEVICE)
    traced = torch.jit.trace(norm.__call__, (x,), check_trace=False)
    torch.testing.assert_close(traced(x), norm(x), rtol=1e-5, atol=1e-6)


def test_unknown_kernel_choice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from pocketllm.errors import UnsupportedOptionError
    from pocketllm_torch import triton_ops

    monkeypatch.setenv(triton_ops.KERNELS_ENV, "cuda-graphs")
    with pytest.raises(UnsupportedOptionError, match="POCKETLLM_TORCH_KERNELS"):
        triton_ops.use_triton(torch.zeros(1))


@pytest.mark.parametrize(("heads", "k_dim", "v_dim"), [(2, 32, 32), (3, 64, 48), (1, 128, 128)])
def test_gated_delta_decode_equals_the_torch_path(heads: int, k_dim: int, v_dim: int) -> None:
    """The convolution's update and the recurrent delta rule for three sequences in slots out of order: the outputs
    and the slots' new states of the torch path, and the other slots untouched."""
    from pocketllm_torch.models.qwen3_5 import GatedDeltaNet, l2norm, recurrent_gated_delta_rule
    from pocketllm_torch.triton_kernels import gated_delta

    gen = torch.Generator().manual_seed(heads * k_dim + v_dim)
    channels, kernel, batch = 40, 4, 3
    slots = torch.tensor([4, 0, 2])
    conv = torch.randn(5, channels, kernel - 1, generator=gen)
    weight = torch.randn(channels, kernel, generator=gen)
    x = torch.randn(batch, channels, generator=gen)
    expected_conv = conv.clone()
    expected = GatedDeltaNet._conv_step(_Conv(weight), x, expected_conv, slots)  # type: ignore[arg-type]
    got_conv = conv.to(DEVICE)
    got = gated_delta.conv_update(x.to(DEVICE), got_conv, slots.to(DEVICE), weight.to(DEVICE))
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_conv.cpu(), expected_conv)

    q, k = (l2norm(torch.randn(batch, heads, k_dim, generator=gen)) for _ in range(2))
    v = torch.randn(batch, heads, v_dim, generator=gen)
    g, beta = -torch.rand(batch, heads, generator=gen), torch.rand(batch, heads, generator=gen)
    state = torch.randn(5, heads, k_dim, v_dim, generator=gen)
    out, new_state = recurrent_gated_delta_rule(q, k, v, g, beta, state[slots])
    got_state = state.to(DEVICE)
    got_out = gated_delta.delta_step(*(t.to(DEVICE) for t in (q, k, v, g, beta)), got_state, slots.to(DEVICE))
    torch.testing.assert_close(got_out.cpu(), out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_state.cpu()[slots], new_state, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_state.cpu()[[1, 3]], state[[1, 3]])


class _Conv:
    """What GatedDeltaNet._conv_step reads of its layer."""

    def __init__(self, conv_weight: torch.Tensor) -> None:
        self.conv_weight = conv_weight


def test_paged_attention_reads_an_fp8_cache() -> None:
    """kv_cache_dtype="fp8": the kernel reads the e4m3 cache as the torch path does."""
    from pocketllm_torch.attention import FP8

    gen = torch.Generator().manual_seed(8)
    cache = KVCache(1, 4, BLOCK_SIZE, 2, 64, FP8, DEVICE)
    cache.zero_new_blocks([[3, 1]])
    q = torch.randn(20, 4, 64, generator=gen).to(DEVICE)
    kv = (torch.randn(2, 2, 20, 64, generator=gen) * 4).to(DEVICE)
    positions, meta = build_metadata([0], [20], [[3, 1]], BLOCK_SIZE, DEVICE, torch.float32)
    expected = reference_attention(q, kv, cache.layers[0], meta, 0.125)
    seq = torch.zeros(20, dtype=torch.int64, device=DEVICE)
    got = attention.paged_attention(q, cache.layers[0], meta.context_blocks, seq, positions, BLOCK_SIZE, 0.125)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_the_exponential_race_draws_each_token_by_its_probability() -> None:
    """1,200 rows of the same probabilities (one of them zero), each with its own seed: the draws' frequencies
    are the probabilities (each within 5 standard deviations), the zero is never drawn, and a row draws the same
    token whatever rows are beside it."""
    from pocketllm_torch.triton_kernels import sampling

    p = torch.tensor([0.5, 0.3, 0.0, 0.15, 0.05])
    rows = 1200
    seeds = torch.arange(rows, dtype=torch.int64) * 0x9E3779B97F4A7C1 - (1 << 62)
    drawn = sampling.exponential_race(p.repeat(rows, 1).to(DEVICE), seeds.to(DEVICE)).cpu()
    counts = torch.bincount(drawn, minlength=5).double()
    assert counts[2] == 0
    sd = (rows * p * (1 - p)).double().sqrt()
    assert ((counts - rows * p).abs() <= 5 * sd + 1).all(), counts
    alone = sampling.exponential_race(p.unsqueeze(0).to(DEVICE), seeds[17:18].to(DEVICE)).cpu()
    assert alone.item() == drawn[17].item()
    wider = torch.rand(3, 5000, generator=torch.Generator().manual_seed(1))
    batch = sampling.exponential_race(wider.to(DEVICE), seeds[:3].to(DEVICE)).cpu()
    singles = [sampling.exponential_race(wider[i:i + 1].to(DEVICE), seeds[i:i + 1].to(DEVICE)).item()
               for i in range(3)]
    assert batch.tolist() == singles  # several blocks of the vocabulary per row, too


_SEEDED = """
import json, sys
from pocketllm import LLM, SamplingParams
llm = LLM(sys.argv[1], backend="torch", device=sys.argv[2], dtype="float32", max_model_len=128)
params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7, max_tokens=10, ignore_eos=True)
other = SamplingParams(temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
alone = llm.generate([[5, 9, 13]], params)[0].outputs[0].token_ids
together = llm.generate([[7, 60, 61, 62], [5, 9, 13]], [other, params])[1].outputs[0].token_ids
seeds = [llm.generate([[5, 9, 13]], SamplingParams(temperature=0.9, seed=s, max_tokens=10, ignore_eos=True))[0]
         .outputs[0].token_ids for s in (1, 2, 3)]
print(json.dumps([alone, together, seeds]))
"""


def test_seeded_sampling_through_the_kernels_is_the_same_alone_or_batched(pocketllm_kit_checkpoint) -> None:
    import json
    import subprocess
    import sys

    env = os.environ | {"POCKETLLM_TORCH_KERNELS": "triton"}
    done = subprocess.run([sys.executable, "-c", _SEEDED, str(pocketllm_kit_checkpoint("llama")), DEVICE.type],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    alone, together, seeds = json.loads(done.stdout.strip().splitlines()[-1])
    assert alone == together and len(alone) == 10  # second in its batch: keyed by its seed, not its row
    assert len({tuple(ids) for ids in seeds}) > 1  # and the seed matters
