"""The native grouped-linear kernels: every instruction set, any batch, bad input as Python errors."""

from __future__ import annotations

import os

import pytest
import torch

from pocketllm_torch import native

# CI builds them (nox -s tests sets it): there, a failed build must fail these tests rather than skip them.
REQUIRED = os.environ.get("POCKETLLM_REQUIRE_NATIVE") == "1"
pytestmark = pytest.mark.skipif(not (native.available() or REQUIRED), reason="native kernels not built")


def test_native_kernels_are_built() -> None:
    assert native.available()


def test_kernels_built_for_another_torch_are_not_loaded(monkeypatch) -> None:
    import pocketllm_torch._built_for as built_for

    monkeypatch.setattr(built_for, "TORCH_VERSION", "0.0.1")
    native.available.cache_clear()
    try:
        assert not native.available()
    finally:
        monkeypatch.undo()
        native.available.cache_clear()
    assert native.available()


def isas() -> list[str]:
    """The scalar path everywhere, and AVX2 and AVX-512 where this CPU has them."""
    vector = ["avx2", "avx512"]
    best = native.kernel_isa()
    return ["scalar"] + (vector[:vector.index(best) + 1] if best in vector else [])


@pytest.fixture(params=isas())
def isa(request):
    before = native.kernel_isa()
    yield native.kernel_isa(request.param)
    native.kernel_isa(before)


def weights(bits: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, dequantized [n, k]) for random groups of the given width."""
    g = torch.Generator().manual_seed(n * k + bits)
    scale = torch.rand(n, k // 32, generator=g) * 0.02 + 0.005
    if bits == 4:
        codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
        offset = -8 * scale + 0.01 * torch.randn(n, k // 32, generator=g)
        packed = native.pack_int4(codes, scale, offset)
        dense = codes.float() * scale.repeat_interleave(32, 1) + offset.repeat_interleave(32, 1)
    else:
        codes = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
        packed = native.pack_int8(codes, scale)
        dense = codes.float() * scale.repeat_interleave(32, 1)
    return packed, dense


def op(bits: int):
    return native.int4_linear if bits == 4 else native.int8_linear


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13])
def test_matches_float32_matmul(isa: str, bits: int, rows: int) -> None:
    packed, dense = weights(bits, 48, 96)
    x = torch.randn(rows, 96)
    got = op(bits)(x, packed, 48)
    ref = x @ dense.T
    assert got.dtype == torch.float32 and got.shape == (rows, 48)
    assert (got - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_gives_the_same_bits_in_any_batch(isa: str, bits: int) -> None:
    """Rows are computed independently in the same order: batching never changes a sequence's numbers. Few rows
    (decode) and many (prefill, group by group, in passes and tiles of rows) take different loops; 3 blocks of
    outputs make AVX-512 take a pair of blocks and a single one."""
    packed, _ = weights(bits, 48, 96)
    x = torch.randn(300, 96)
    together = op(bits)(x, packed, 48)
    for i in (0, 1, 5, 17, 130, 299):
        assert torch.equal(op(bits)(x[i:i + 1], packed, 48)[0], together[i])
    for start, stop in ((0, 4), (2, 7), (3, 40), (100, 300)):
        assert torch.equal(op(bits)(x[start:stop], packed, 48), together[start:stop])


def test_isas_agree() -> None:
    """The scalar path within rounding; the vector paths bit for bit, so a row's numbers do not depend on the
    path its batch takes either."""
    if "avx2" not in isas():
        pytest.skip("no AVX2 here")
    packed, _ = weights(4, 64, 128)
    x = torch.randn(40, 128)
    before = native.kernel_isa()
    try:
        results = {name: [op(4)(x[:rows], packed, 64) for rows in (1, 4, 6, 40)]
                   for name in isas() if native.kernel_isa(name)}
    finally:
        native.kernel_isa(before)
    for scalar, vector in zip(results["scalar"], results["avx2"], strict=True):
        torch.testing.assert_close(scalar, vector, rtol=1e-5, atol=1e-5)
    for avx2, avx512 in zip(results["avx2"], results.get("avx512", results["avx2"]), strict=True):
        assert torch.equal(avx2, avx512)


def test_bad_input_raises_instead_of_crashing() -> None:
    packed, _ = weights(4, 32, 64)
    x = torch.randn(2, 64)
    cases = [
        (x.double(), packed, 32, "float32"),
        (x[0], packed, 32, "2-D"),
        (torch.randn(2, 96), packed, 32, "features"),
        (x, packed, 48, "out_features"),
        (x, packed[..., :100], 32, "packed"),
        (x, packed.float(), 32, "packed"),
        (x, weights(8, 32, 64)[0], 32, "packed"),  # an 8-bit layout handed to the 4-bit kernel
    ]
    for args in cases:
        with pytest.raises(RuntimeError, match=args[-1]):
            native.int4_linear(*args[:-1])
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        native.kernel_isa("neon")
    with pytest.raises(ValueError, match="groups"):
        native.pack_int4(torch.zeros(32, 48, dtype=torch.uint8), torch.ones(32, 1), torch.zeros(32, 1))


def test_empty_batch() -> None:
    packed, _ = weights(8, 16, 32)
    assert native.int8_linear(torch.zeros(0, 32), packed, 16).shape == (0, 16)


def reference_attention(q, cache, tables, lens, block_size, scale):
    """Softmax attention of each sequence's query over its first lens[b] cached positions, in float64."""
    heads, kv_heads = q.shape[1], cache.shape[1]
    out = []
    for b, table in enumerate(tables):
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(lens[b])])
        k, v = (cache[i][:, slots].double().repeat_interleave(heads // kv_heads, 0) for i in (0, 1))
        p = torch.softmax((k @ q[b].double()[:, :, None]).squeeze(-1) * scale, -1)  # [H, L]
        out.append((p[:, None, :] @ v).squeeze(1).flatten())
    return torch.stack(out).float()


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "block_size"), [(9, 3, 64, 16), (4, 4, 40, 4), (2, 1, 16, 8)])
def test_paged_decode_attention_matches_softmax_attention(isa: str, heads: int, kv_heads: int, dim: int,
                                                          block_size: int) -> None:
    g = torch.Generator().manual_seed(heads * dim)
    num_blocks, lens = 40, [1, 5, block_size, 37, 3 * block_size + 1]
    cache = torch.randn(2, kv_heads, num_blocks * block_size, dim, generator=g)
    # Shuffled, interleaved tables; a row is padded with block 0 past its sequence's blocks.
    order = torch.randperm(num_blocks - 1, generator=g) + 1
    need = [-(-n // block_size) for n in lens]
    tables, used = [], 0
    for n in need:
        tables.append(order[used:used + n].tolist() + [0] * (max(need) - n))
        used += n
    q = torch.randn(len(lens), heads, dim, generator=g)
    got = native.paged_decode_attention(q, cache, torch.tensor(tables), torch.tensor(lens), block_size, dim ** -0.5)
    ref = reference_attention(q, cache, tables, lens, block_size, dim ** -0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_paged_decode_attention_refuses_bad_tables() -> None:
    cache = torch.randn(2, 1, 8 * 4, 16)
    q = torch.randn(1, 2, 16)

    def run(table, length, block_size=4, cache=cache, q=q):
        return native.paged_decode_attention(q, cache, torch.tensor([table]), torch.tensor([length]), block_size, 1.0)

    run([1, 2], 8)
    for args, message in [(([1, 8], 8), "outside the cache"), (([1, -1], 5), "outside the cache"),
                          (([1, 2], 9), "table holds 8"), (([1, 2], 0), "context length 0"),
                          (([1, 2], 8, 3), "does not divide"),
                          (([1, 2], 8, 4, cache.double()), "float32"),
                          (([1], 4, 4, torch.randn(2, 2, 32, 16), torch.randn(1, 3, 16)), "kv heads evenly")]:
        with pytest.raises(RuntimeError, match=message):
            run(*args)


@pytest.mark.parametrize("rows", [1, 3, 300])  # 300 rows of 100: more than one thread's grain
def test_fused_row_kernels_match_torch(isa: str, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, delta = torch.randn(rows, 100, generator=g) * 3, torch.randn(rows, 100, generator=g)
    weight = torch.rand(100, generator=g) + 0.5

    def norm(t: torch.Tensor) -> torch.Tensor:
        return t * torch.rsqrt(t.double().pow(2).mean(-1, keepdim=True) + 1e-5).float() * weight

    torch.testing.assert_close(native.rms_norm(x, weight, 1e-5), norm(x), rtol=1e-5, atol=1e-5)
    total, normed = native.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(total, x + delta)
    torch.testing.assert_close(normed, norm(x + delta), rtol=1e-5, atol=1e-5)
    gate_up = torch.cat([torch.linspace(-100, 100, 50).expand(rows, 50), torch.randn(rows, 50, generator=g)], 1)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(native.silu_mul(gate_up.contiguous()), torch.nn.functional.silu(gate) * up,
                               rtol=1e-5, atol=1e-6)


def test_fused_row_kernels_refuse_bad_input() -> None:
    x, w = torch.randn(2, 8), torch.ones(8)
    for call, message in [(lambda: native.rms_norm(x.double(), w, 1e-5), "float32"),
                          (lambda: native.rms_norm(x.t(), w, 1e-5), "contiguous"),
                          (lambda: native.rms_norm(x, torch.ones(7), 1e-5), "8 elements"),
                          (lambda: native.add_rms_norm(x, torch.randn(3, 8), w, 1e-5), "differ in shape"),
                          (lambda: native.silu_mul(torch.randn(2, 7)), "even number")]:
        with pytest.raises(RuntimeError, match=message):
            call()
    assert not native.takes_rows(x.t()) and not native.takes_rows(x.double()) and native.takes_rows(x)


def _gated_delta_layer(hk: int, hv: int, dk: int, dv: int, kernel: int, g: torch.Generator, tiled: bool = False):
    from pocketllm_torch.models.qwen3_5 import GatedDeltaNet, GatedRMSNorm

    channels = 2 * hk * dk + hv * dv
    return GatedDeltaNet(in_proj=None, conv_weight=torch.randn(channels, kernel, generator=g),
                         decay_rate=-torch.rand(hv, generator=g).exp(), dt_bias=torch.randn(hv, generator=g),
                         norm=GatedRMSNorm(torch.rand(dv, generator=g) + 0.5, 1e-6), out_proj=None,
                         num_k_heads=hk, num_v_heads=hv, k_dim=dk, v_dim=dv, tiled_heads=tiled)


def _gated_delta_reference(layer, proj: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor,
                           slots: torch.Tensor) -> torch.Tensor:
    """The torch path of the model's decode step (qwen3_5.py), on these pools."""
    from pocketllm_torch.models.qwen3_5 import recurrent_gated_delta_rule

    hv, dv = layer.num_v_heads, layer.v_dim
    mixed, z, b, a = proj.split([layer.conv_weight.shape[0], hv * dv, hv, hv], dim=-1)
    g = layer.decay_rate * torch.nn.functional.softplus(a + layer.dt_bias)
    q, k, v = layer._heads(layer._conv_step(mixed, conv, slots))
    out, state = recurrent_gated_delta_rule(q, k, v, g, b.sigmoid(), recurrent.index_select(0, slots))
    recurrent.index_copy_(0, slots, state)
    return layer.norm(out.reshape(-1, dv), z.reshape(-1, dv)).view(proj.shape[0], hv * dv)


@pytest.mark.parametrize(("hk", "hv", "batch", "tiled"), [(2, 4, 3, False), (2, 4, 3, True), (2, 2, 1, False),
                                                         (1, 3, 2, False), (2, 6, 2, True)])
def test_gated_delta_decode_matches_the_torch_step(hk: int, hv: int, batch: int, tiled: bool) -> None:
    g = torch.Generator().manual_seed(hk * 10 + hv)
    dk, dv, kernel, num_slots = 16, 8, 4, 5
    layer = _gated_delta_layer(hk, hv, dk, dv, kernel, g, tiled)
    channels = layer.conv_weight.shape[0]
    conv = torch.randn(num_slots, channels, kernel - 1, generator=g)
    recurrent = torch.randn(num_slots, hv, dk, dv, generator=g)
    ref_conv, ref_recurrent = conv.clone(), recurrent.clone()
    slots = torch.tensor([4, 0, 2][:batch])
    for step in range(3):  # the states each step leaves are the next one's
        proj = torch.randn(batch, channels + hv * dv + 2 * hv, generator=g) * (1 + step)
        out = native.gated_delta_decode(proj, conv, recurrent, slots, layer.conv_weight, layer.decay_rate,
                                        layer.dt_bias, layer.norm.weight, hk, tiled, 1e-6)
        expected = _gated_delta_reference(layer, proj, ref_conv, ref_recurrent, slots)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(conv, ref_conv, rtol=0, atol=0)
        torch.testing.assert_close(recurrent, ref_recurrent, rtol=1e-4, atol=1e-5)


def test_gated_delta_decode_refuses_bad_input() -> None:
    g = torch.Generator().manual_seed(0)
    layer = _gated_delta_layer(2, 4, 16, 8, 4, g)
    channels = layer.conv_weight.shape[0]
    conv, recurrent = torch.zeros(3, channels, 3), torch.zeros(3, 4, 16, 8)
    proj, two_slots = torch.randn(2, channels + 4 * 8 + 8), torch.tensor([0, 1])

    def run(proj=proj, conv=conv, recurrent=recurrent, slots=two_slots, heads=2):
        return native.gated_delta_decode(proj, conv, recurrent, slots, layer.conv_weight, layer.decay_rate,
                                         layer.dt_bias, layer.norm.weight, heads, False, 1e-6)

    for kwargs, message in [({"slots": torch.tensor([0, 3])}, "out of range"),
                            ({"slots": torch.tensor([-1, 0])}, "out of range"),
                            ({"slots": torch.tensor([1, 1])}, "given twice"),
                            ({"slots": torch.tensor([0])}, "slots"),
                            ({"proj": proj[:, 1:].contiguous()}, "columns"),
                            ({"proj": proj.double()}, "float32"),
                            ({"heads": 3}, "multiple"),
                            ({"heads": 0}, "multiple"),
                            ({"recurrent": torch.zeros(2, 4, 16, 8)}, "slot counts"),
                            ({"conv": torch.zeros(3, channels + 1, 3)}, "channels")]:
        with pytest.raises(RuntimeError, match=message):
            run(**kwargs)
    assert torch.equal(conv, torch.zeros_like(conv)) and torch.equal(recurrent, torch.zeros_like(recurrent))
