"""pocketllm-cpp's kernels against numpy references, on every ISA this CPU has (scalar always), and on bad input."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

kernels = pytest.importorskip("pocketllm_cpp.kernels")

from pocketllm.checkpoint import load_checkpoint  # noqa: E402
from tests.cpp.weights import BLOCK32_TYPES, QUANTIZED_TYPES, random_weight, reference_activations  # noqa: E402

ISAS = kernels.available_isas().split()  # scalar always, and each SIMD path this CPU runs


@pytest.fixture(params=ISAS)
def isa(request: pytest.FixtureRequest):
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa("auto")


def test_activation_quantization_matches_numpy(isa: str) -> None:
    x = np.random.default_rng(1).standard_normal((5, 96)).astype(np.float32)
    x[2, :32] = 0.0  # an all-zero block
    scales, sums, codes = kernels.quantize_activations(x)
    blocks = x.reshape(5, 3, 32)
    expected_scales = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    np.testing.assert_array_equal(scales, expected_scales)
    expected = reference_activations(x) / np.repeat(expected_scales.astype(np.float64), 32, axis=1).clip(1e-30)
    np.testing.assert_array_equal(codes, np.rint(expected).astype(np.int8))
    np.testing.assert_allclose(sums, scales * codes.reshape(5, 3, 32).sum(-1), rtol=1e-6)


@pytest.mark.parametrize("storage_type", ["F32", "F16", "BF16", *QUANTIZED_TYPES])
@pytest.mark.parametrize("n", [1, 3, 17])
def test_matmul_matches_numpy(isa: str, storage_type: str, n: int) -> None:
    rows, cols = 42, 512  # rows: whole tiles and a remainder; 2 super-blocks of 256
    raw, w = random_weight(storage_type, rows, cols)
    x = np.random.default_rng(2).standard_normal((n, cols)).astype(np.float32)
    y = kernels._native.matmul(raw, storage_type, rows, cols, x)
    xs = reference_activations(x) if storage_type in QUANTIZED_TYPES else x.astype(np.float64)
    expected = xs @ w.T
    scale = np.abs(xs) @ np.abs(w).T  # the size of the terms summed: relative error is against this
    assert y.shape == (n, rows) and y.dtype == np.float32
    assert np.all(np.abs(y - expected) <= 1e-5 * scale + 1e-6)


@pytest.mark.parametrize("storage_type", BLOCK32_TYPES)
@pytest.mark.parametrize("n", [1, 2, 5])
def test_matmul_rows_ending_in_a_partial_group_of_blocks(isa: str, storage_type: str, n: int) -> None:
    # 19 blocks of 32 per row: two groups of 8 and a last group of 3, the default model's 576 columns' shape.
    rows, cols = 13, 608
    raw, w = random_weight(storage_type, rows, cols, seed=4)
    x = np.random.default_rng(5).standard_normal((n, cols)).astype(np.float32)
    y = kernels._native.matmul(raw, storage_type, rows, cols, x)
    xs = reference_activations(x)
    assert np.all(np.abs(y - xs @ w.T) <= 1e-5 * (np.abs(xs) @ np.abs(w).T) + 1e-6)


@pytest.mark.parametrize(("storage_type", "cols"), [(q, 512) for q in ("F32", "F16", "BF16", *QUANTIZED_TYPES)]
                         # a last, partial group of 3, 2 (the default model's 576) and 7 blocks
                         + [(q, cols) for q in BLOCK32_TYPES for cols in (608, 576, 480)])
def test_a_row_is_the_same_bits_alone_and_in_any_batch(isa: str, storage_type: str, cols: int) -> None:
    # One row is the decode path, 2 and more the batched tiles (2, 4, their remainders; with AMX, 64 and more rows
    # its tiles of 16, a partial one, and weight rows past its panels of 16): a row's products must not depend on
    # the rows beside it, or a seeded request samples differently when others share its step.
    rows = 42
    raw, _ = random_weight(storage_type, rows, cols, seed=7)
    x = np.random.default_rng(8).standard_normal((70, cols)).astype(np.float32)
    alone = np.vstack([kernels._native.matmul(raw, storage_type, rows, cols, x[i:i + 1]) for i in range(len(x))])
    for n in (2, 3, 4, 5, 8, 17, 64, 70):
        np.testing.assert_array_equal(kernels._native.matmul(raw, storage_type, rows, cols, x[:n]), alone[:n])
    shuffled = np.random.default_rng(9).permutation(len(x))
    np.testing.assert_array_equal(kernels._native.matmul(raw, storage_type, rows, cols, x[shuffled]), alone[shuffled])


@pytest.mark.parametrize("storage_type", ["F32", "BF16", *QUANTIZED_TYPES])
def test_a_long_batch_runs_in_blocks_of_rows_with_the_same_bits(isa: str, storage_type: str) -> None:
    # Past 256 rows a product runs a block of rows at a time (matmul.cpp's kRowBlock): 600 rows are two whole
    # blocks and one of 88, 530 two and one of 18 (below AMX's 64 rows). Each block's rows must land in their own
    # places and be what they are in batches of 50.
    rows, cols = 42, 512
    raw, _ = random_weight(storage_type, rows, cols, seed=11)
    x = np.random.default_rng(12).standard_normal((600, cols)).astype(np.float32)
    pieces = np.vstack([kernels._native.matmul(raw, storage_type, rows, cols, x[r:r + 50]) for r in range(0, 600, 50)])
    for n in (600, 530):
        np.testing.assert_array_equal(kernels._native.matmul(raw, storage_type, rows, cols, x[:n]), pieces[:n])


@pytest.mark.parametrize("storage_type", QUANTIZED_TYPES)
def test_exact_mode_multiplies_float32_activations(storage_type: str) -> None:
    raw, w = random_weight(storage_type, 24, 256)
    x = np.random.default_rng(6).standard_normal((3, 256)).astype(np.float32)
    y = kernels._native.matmul(raw, storage_type, 24, 256, x, exact=True)
    np.testing.assert_allclose(y, x.astype(np.float64) @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("storage_type", QUANTIZED_TYPES)
def test_isas_agree(storage_type: str) -> None:
    raw, _ = random_weight(storage_type, 64, 256)
    x = np.random.default_rng(3).standard_normal((70, 256)).astype(np.float32)
    results = {}
    for isa in ISAS:
        kernels.set_isa(isa)
        results[isa] = kernels._native.matmul(raw, storage_type, 64, 256, x)
    kernels.set_isa("auto")
    for y in results.values():  # 7 rows: more meet a sum that cancels to below these tolerances
        np.testing.assert_allclose(y[:7], results["scalar"][:7], rtol=1e-5, atol=1e-5)
    if "amx" in results:  # 70 rows on the tiles: the AVX-512 kernels' integers, then their float steps, in order
        np.testing.assert_array_equal(results["amx"], results["avx512"])


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def test_amx_is_offered_exactly_where_the_cpu_has_it() -> None:
    # Built where the compiler knows the tiles, on Linux; Linux must also grant the tile state (it refuses where a
    # thread's signal stack is too small for AMX's larger frame, which no test process has).
    flags = cpu_flags()
    has_amx = {"amx_tile", "amx_int8", "avx512_vnni"} <= flags and "amx" in kernels._native.built_isas().split()
    assert ("amx" in ISAS) == has_amx, (ISAS, sorted(f for f in flags if f.startswith("amx")))
    if has_amx:
        assert kernels.best_isa() == "amx"
    else:
        with pytest.raises(ValueError, match="'amx' is not available"):
            kernels.set_isa("amx")


@pytest.mark.parametrize("storage_type", ["F16", "BF16", *QUANTIZED_TYPES])
def test_dequantize_equals_gguf(storage_type: str) -> None:
    raw, w = random_weight(storage_type, 16, 256)
    np.testing.assert_array_equal(kernels._native.dequantize(raw, storage_type, 16, 256), w.astype(np.float32))


def test_checkpoint_tensors_in_place(pocketllm_kit_checkpoint) -> None:
    """The kit GGUF's blocks straight from the memory map: equal to the reader's dequantized values."""
    checkpoint = load_checkpoint(str(pocketllm_kit_checkpoint("llama-gguf")))
    x = np.random.default_rng(4).standard_normal((2, 128)).astype(np.float32)
    for tensor in checkpoint.tensors():
        if tensor.storage_type in QUANTIZED_TYPES and tensor.row_permutation is None and tensor.shape[1] == 128:
            w = tensor.dequantize().astype(np.float64)
            np.testing.assert_array_equal(kernels.dequantize(tensor), w.astype(np.float32))
            y = kernels.matmul(tensor, x)
            expected = reference_activations(x) @ w.T
            assert np.all(np.abs(y - expected) <= 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-6), tensor.name


@pytest.mark.parametrize(("args", "message"), [
    (("Q8_0", 40, 128), None),  # the valid call, for contrast
    (("Q8_0", 41, 128), "bytes"),
    (("Q8_0", 40, 100), "multiple of 32"),
    (("Q8_0", -40, 128), "positive"),
    (("Q8_0", 2**62, 2**40), "bytes"),
    (("IQ2_XS", 40, 128), "storage type"),
    (("Q4_K", 40, 128), "multiple of 256"),
])
def test_bad_arguments_raise_value_error(args: tuple, message: str | None) -> None:
    raw, _ = random_weight("Q8_0", 40, 128)
    x = np.zeros((1, 128), np.float32)  # the weight is checked first
    if message is None:
        assert kernels._native.matmul(raw, *args, x).shape == (1, 40)
        return
    with pytest.raises(ValueError, match=message):
        kernels._native.matmul(raw, *args, x)


def test_bad_activations_and_alignment_raise_value_error() -> None:
    raw, _ = random_weight("F32", 8, 64)
    with pytest.raises(ValueError, match="columns"):
        kernels._native.matmul(raw, "F32", 8, 64, np.zeros((2, 32), np.float32))
    shifted = np.zeros(raw.size + 1, np.uint8)[1:]
    shifted[:] = raw
    with pytest.raises(ValueError, match="aligned"):
        kernels._native.matmul(shifted, "F32", 8, 64, np.zeros((1, 64), np.float32))
    with pytest.raises(TypeError):
        kernels._native.matmul(raw, "F32", 8, 64, np.zeros(64, np.float32))  # not a matrix


def test_matmul_releases_the_gil() -> None:
    raw, _ = random_weight("Q4_0", 2048, 2048)
    x = np.random.default_rng(5).standard_normal((256, 2048)).astype(np.float32)  # tens of ms per product
    ticks, done = [0], threading.Event()

    def work() -> None:
        # Long enough to tell, however fast the machine's kernels: a GIL held through each product would let the
        # main thread tick about once per product, far below once per 5 ms.
        deadline = time.perf_counter() + 0.3
        while time.perf_counter() < deadline:
            kernels._native.matmul(raw, "Q4_0", 2048, 2048, x)
        done.set()

    thread = threading.Thread(target=work)
    started = time.perf_counter()
    thread.start()
    while not done.is_set():
        ticks[0] += 1
        time.sleep(0.0005)
    thread.join()
    elapsed = time.perf_counter() - started
    assert ticks[0] >= elapsed / 0.005, f"the main thread ran {ticks[0]} times in {elapsed:.3f} s"


def test_the_library_works_from_cpp_alone() -> None:
    binary = Path(kernels.__file__).with_name("pocketllm_cpp_test")
    result = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("ok"), result.stdout + result.stderr


@pytest.mark.parametrize(("value", "expected"), [("scalar", "scalar"), ("auto", None), ("no-such-isa", None)])
def test_isa_variable(value: str, expected: str | None) -> None:
    import os
    import sys

    code = "from pocketllm_cpp import kernels; print(kernels.isa())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "POCKETLLM_CPP_ISA": value}).stdout.strip()
    assert out == (expected or kernels.best_isa())  # an unusable value falls back to the best ISA


def test_the_library_is_clean_under_address_and_undefined_behaviour_sanitizers(tmp_path: Path) -> None:
    """What `nox -s sanitize` does, in the suite: the C++ test (kernels, model, engine) built with ASan and UBSan."""
    import os
    import shutil

    source = Path(__file__).resolve().parents[2] / "packages" / "pocketllm-cpp"
    if not (shutil.which("cmake") and shutil.which("ninja") and (source / "CMakeLists.txt").is_file()):
        pytest.skip("needs cmake, ninja and the pocketllm-cpp sources")
    flags = "-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all"
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Debug",
                    f"-DCMAKE_CXX_FLAGS={flags}", f"-DCMAKE_EXE_LINKER_FLAGS={flags}"], check=True,
                   capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "pocketllm_cpp_test"], check=True,
                   capture_output=True, timeout=600)
    for isa in ("scalar", "auto"):
        result = subprocess.run([str(build / "pocketllm_cpp_test")], capture_output=True, text=True, timeout=120,
                                env={**os.environ, "POCKETLLM_CPP_ISA": isa})
        assert result.returncode == 0 and result.stdout.startswith("ok"), result.stdout + result.stderr


def test_the_neon_kernels_match_the_scalar_ones_on_arm64(tmp_path: Path) -> None:
    """The AArch64 build (NEON kernels) cross-compiled and run under qemu-aarch64: the C++ test checks every
    kernel of every ISA against the scalar path. The suite's nox session installs the cross compiler and qemu."""
    import os
    import shutil

    source = Path(__file__).resolve().parents[2] / "packages" / "pocketllm-cpp"
    tools = ("cmake", "ninja", "aarch64-linux-gnu-g++", "qemu-aarch64")
    if not (all(shutil.which(t) for t in tools) and (source / "CMakeLists.txt").is_file()):
        pytest.skip(f"needs {', '.join(tools)} and the pocketllm-cpp sources")
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DCMAKE_SYSTEM_NAME=Linux", "-DCMAKE_SYSTEM_PROCESSOR=aarch64",
                    "-DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++"], check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "pocketllm_cpp_test"], check=True,
                   capture_output=True, timeout=600)
    for isa in ("scalar", "neon"):
        command = ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu", str(build / "pocketllm_cpp_test")]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300,
                                env={**os.environ, "POCKETLLM_CPP_ISA": isa})
        assert result.returncode == 0 and result.stdout.startswith("ok: isa neon"), result.stdout + result.stderr


def test_capabilities_list_exactly_the_quantized_types_these_kernels_run() -> None:
    from pocketllm_cpp.backend import CppBackend

    assert set(CppBackend().capabilities().quantization_formats) == {*QUANTIZED_TYPES, "F8_E4M3"}


@pytest.mark.parametrize("n", [1, 2, 5])
def test_fp8_matmul_and_dequantization_match_numpy(isa: str, n: int) -> None:
    """F8_E4M3 bytes (every finite one) times a scale per 32 columns, against the checkpoint reader's table."""
    from pocketllm.checkpoint.fp8 import fp8_values

    rng = np.random.default_rng(3)
    rows, cols = 40, 96
    codes = rng.integers(0, 256, (rows, cols), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] ^= 1  # no NaN
    codes.reshape(-1)[:127] = np.setdiff1d(np.arange(128), [0x7F])  # every finite positive code
    scales = (rng.random((rows, cols // 32)) * 0.01 + 0.001).astype(np.float32)
    w = fp8_values()[codes] * np.repeat(scales, 32, axis=1)
    args = (codes.reshape(-1), "F8_E4M3", rows, cols)
    np.testing.assert_array_equal(kernels._native.dequantize(*args, scales=scales.reshape(-1)), w)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    y = kernels._native.matmul(*args, x, scales=scales.reshape(-1))
    expected = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.all(np.abs(y - expected) <= 1e-5 * (np.abs(x) @ np.abs(w).T) + 1e-6)
    with pytest.raises(ValueError, match="needs its scales"):
        kernels._native.matmul(*args, x)
    # A scale near float32's top: 2^8 of it would overflow, the kernels' product must not.
    big = np.zeros((8, 32), np.uint8)
    big[0, 0] = 0x38  # 1.0
    huge = np.full(8, 1e37, np.float32)
    y = kernels._native.matmul(big.reshape(-1), "F8_E4M3", 8, 32, np.ones((n, 32), np.float32), scales=huge)
    np.testing.assert_array_equal(y[:, 0], np.float32(1e37))
    assert not y[:, 1:].any()
    with pytest.raises(ValueError, match="scales; its shape needs"):
        kernels._native.matmul(*args, x, scales=scales.reshape(-1)[1:])
