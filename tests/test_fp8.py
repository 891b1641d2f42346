"""FP8 (E4M3) safetensors checkpoints: the reader's scales and reference dequantization, each backend serving them
with the weights kept FP8 (cpp in place from the memory map, torch a tile at a time), equal to the same backend on
the float32 values of those weights, and the layouts no backend serves refused by name."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pocketllm import LLM, SamplingParams  # noqa: E402
from pocketllm.checkpoint import load_checkpoint  # noqa: E402
from pocketllm.checkpoint.fp8 import fp8_values  # noqa: E402
from pocketllm.errors import CheckpointError  # noqa: E402
from tests.fp8_checkpoints import reference_of, write_fp8  # noqa: E402

BACKENDS = [b for b, module in (("torch", "pocketllm_torch"), ("cpp", "pocketllm_cpp._native"))
            if importlib.util.find_spec(module.split(".")[0]) is not None]
PROMPTS = [[5, 9, 13, 2, 40], [7] * 3 + [60, 61, 62, 63, 64, 65]]
# (scales, block): one partial 128 x 128 block per kit matrix, several blocks (32 x 64: two groups of 32 columns
# each), a scale per row, one per tensor.
LAYOUTS = [("block", (128, 128)), ("block", (32, 64)), ("channel", (0, 0)), ("tensor", (0, 0))]


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}{p[1] if p[0] == 'block' else ''}")
def fp8_qwen3(request: pytest.FixtureRequest, pocketllm_kit_checkpoint, tmp_path_factory) -> Path:
    scales, block = request.param
    return write_fp8(pocketllm_kit_checkpoint("qwen3"), tmp_path_factory.mktemp("fp8") / "qwen3-fp8", scales=scales,
                     block=block)


def test_e4m3_table_is_torch_s_conversion() -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    theirs = codes.view(torch.float8_e4m3fn).to(torch.float32).numpy()
    ours = fp8_values()
    finite = ~np.isnan(theirs)
    assert finite.sum() == 254 and np.isnan(ours[~finite]).all()
    np.testing.assert_array_equal(ours[finite], theirs[finite])


def test_reader_attaches_scales_and_dequantizes_exactly(fp8_qwen3: Path) -> None:
    checkpoint = load_checkpoint(str(fp8_qwen3))
    reference = {t.name: t for t in load_checkpoint(str(reference_of(fp8_qwen3))).tensors()}
    tensors = checkpoint.tensors()
    assert checkpoint.quantization == "FP8"
    assert {t.name for t in tensors} == set(reference)  # the scale tensors are not tensors of the model
    fp8 = [t for t in tensors if t.storage_type == "F8_E4M3"]
    assert len(fp8) == 14 and all(t.name.endswith("proj.weight") and t.fp8_scale is not None for t in fp8)
    for t in fp8:
        np.testing.assert_array_equal(t.dequantize(), reference[t.name].dequantize())
        assert t.nbytes == t.shape[0] * t.shape[1]  # one byte per weight


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_checkpoint_equals_its_float32_values(fp8_qwen3: Path, backend: str) -> None:
    """Greedy ids and their logprobs on the FP8 checkpoint are those of the same backend on the float32 values of
    its weights (cpp: the same arithmetic, so the same bits; torch: tiles of the product, within float rounding)."""
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1, ignore_eos=True)
    outputs = []
    for path in (fp8_qwen3, reference_of(fp8_qwen3)):
        llm = LLM(str(path), backend=backend, dtype="float32", max_model_len=128)
        try:
            outputs.append([out.outputs[0] for out in llm.generate(PROMPTS, params)])
        finally:
            llm.shutdown()
    for fp8, dense in zip(*outputs, strict=True):
        assert fp8.token_ids == dense.token_ids
        ours = [lp.logprob for lp in fp8.logprobs]
        theirs = [lp.logprob for lp in dense.logprobs]
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=0 if backend == "cpp" else 1e-4)


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_qwen3_5_equals_its_float32_values(tmp_path: Path, backend: str, moe: bool) -> None:
    """Qwen3.5 as its FP8 releases store it: every projection FP8 (the Gated DeltaNet's, the gated attention's, each
    expert's and the shared expert's), in blocks of 32 x 64 so that every matrix has several."""
    from pocketllm.testing.checkpoints import _write_tokenizer
    from tests.torch.qwen3_5_kit import tiny_qwen3_5

    _, source = tiny_qwen3_5(tmp_path / "hf", moe=moe, shared_expert_ff=64)
    _write_tokenizer(source)
    path = write_fp8(source, tmp_path / "fp8", block=(32, 64))
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1, ignore_eos=True)
    outputs = []
    for model in (path, reference_of(path)):
        llm = LLM(str(model), backend=backend, dtype="float32", max_model_len=128)
        try:
            outputs.append(llm.generate(PROMPTS[:1], params)[0].outputs[0])
            if model == path and backend == "torch" and moe:  # each expert a layer of its own, kept FP8
                from pocketllm_torch.linear import Fp8Linear

                layers = llm.backend_engine.runner.model.layers  # type: ignore[attr-defined]
                experts = next(layer.mlp.experts for layer in layers if hasattr(layer.mlp, "experts"))
                assert all(isinstance(e, Fp8Linear) for e in (*experts.gate_up, *experts.down))
        finally:
            llm.shutdown()
    fp8, dense = outputs
    assert fp8.token_ids == dense.token_ids
    np.testing.assert_allclose([lp.logprob for lp in fp8.logprobs], [lp.logprob for lp in dense.logprobs],
                               rtol=0, atol=0 if backend == "cpp" else 1e-4)


def test_backends_keep_the_weights_fp8(fp8_qwen3: Path) -> None:
    """Neither backend dequantizes the checkpoint at load: cpp reads the file's bytes with the scales beside them,
    torch keeps one byte per weight and dequantizes a tile of rows per product."""
    checkpoint = load_checkpoint(str(fp8_qwen3))
    q_proj = next(t for t in checkpoint.tensors() if t.name.endswith("0.self_attn.q_proj.weight"))
    if "cpp" in BACKENDS:
        from pocketllm_cpp.loading import tensor_of

        native = tensor_of(q_proj)
        assert native.storage_type == "F8_E4M3" and native.data.nbytes == q_proj.nbytes
        assert native.scales is not None and native.scales.size == q_proj.shape[0] * q_proj.shape[1] // 32
    if "torch" in BACKENDS:
        from pocketllm_torch.groups import Fp8Groups, GroupFormats, load
        from pocketllm_torch.linear import Fp8Linear, Fp8Weight, make_linear

        groups = load(q_proj, GroupFormats(int4=True, int8=True))
        assert isinstance(groups, Fp8Groups) and groups.codes.dtype == np.uint8
        layer = make_linear(Fp8Weight.from_groups(groups), None, torch.device("cpu"), torch.float32)
        assert isinstance(layer, Fp8Linear)
        x = torch.randn(3, q_proj.shape[1])
        expected = x @ torch.from_numpy(np.array(q_proj.dequantize())).T
        torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_blocks_larger_than_the_matrix_cost_no_more_than_it(pocketllm_kit_checkpoint, tmp_path: Path) -> None:
    """weight_block_size [2^20, 1]: one block of rows, a scale per column; reading and expanding the scales costs
    what the matrix does, not 2^20 rows (and FP8 tensors still hash and compare like the others)."""
    import tracemalloc

    path = write_fp8(pocketllm_kit_checkpoint("qwen3"), tmp_path / "fp8", block=(1 << 20, 1))
    reference = {t.name: t.dequantize() for t in load_checkpoint(str(reference_of(path))).tensors()}
    tracemalloc.start()  # numpy's allocations included
    try:
        tensors = load_checkpoint(str(path)).tensors()
        values = {t.name: t.dequantize() for t in tensors}
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20  # 2^20 rows of one matrix's 64 column scales alone would be 256 MiB
    for t in tensors:
        np.testing.assert_array_equal(values[t.name], reference[t.name])
        if t.storage_type == "F8_E4M3":
            assert t.fp8_scale is not None and t.fp8_scale.block == (t.shape[0], 1)
            assert hash(t) == hash(t) and t in [t]


def test_llm_compressor_block_scales(pocketllm_kit_checkpoint, tmp_path: Path) -> None:
    """llm-compressor's FP8 block strategy: ``weight_scale`` per block, the block size in the config group's weights
    scheme (compressed-tensors, float-quantized), dynamic activations: the values of the same blocks as
    ``weight_scale_inv`` with ``weight_block_size``."""
    from safetensors.torch import load_file, save_file

    path = write_fp8(pocketllm_kit_checkpoint("qwen3"), tmp_path / "fp8", block=(32, 64))
    weights = {name.replace(".weight_scale_inv", ".weight_scale"): t
               for name, t in load_file(path / "model.safetensors").items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    scheme = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "block",
              "block_structure": [32, 64]}
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group",
                   "group_size": 128}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme, "input_activations": activations}}}
    (path / "config.json").write_text(json.dumps(config))
    reference = {t.name: t.dequantize() for t in load_checkpoint(str(reference_of(path))).tensors()}
    tensors = load_checkpoint(str(path)).tensors()
    assert sum(t.storage_type == "F8_E4M3" for t in tensors) == 14
    for t in tensors:
        np.testing.assert_array_equal(t.dequantize(), reference[t.name])


def _rewrite(path: Path, config: dict | None = None, **tensors: object) -> Path:
    from safetensors.torch import load_file, save_file

    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    weights = load_file(path / "model.safetensors")
    for name, value in tensors.items():
        name = name.replace("__", ".")
        if value is None:
            del weights[name]
        else:
            weights[name] = value  # type: ignore[assignment]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize(("change", "message"), [
    ("static activations", "static FP8 activation scales"),
    ("other method", "quantization method 'gptq' is not supported"),
    ("e5m2", "FP8 format 'e5m2'"),
    ("missing scale", "has no"),
    ("scale shape", "needs [1, 1]"),
    ("nan scale", "not finite"),
    ("orphan scale", "scale tensors without an F8_E4M3 weight"),
    ("huge scale", "scales above"),
])
def test_layouts_no_backend_serves_are_refused(pocketllm_kit_checkpoint, tmp_path: Path, change: str,
                                               message: str) -> None:
    path = write_fp8(pocketllm_kit_checkpoint("qwen3"), tmp_path / "fp8")
    config = json.loads((path / "config.json").read_text())
    layer = "model__layers__0__self_attn__q_proj__"
    if change == "static activations":
        _rewrite(path, None, **{layer + "input_scale": torch.ones(())})
    elif change == "other method":
        _rewrite(path, config | {"quantization_config": {"quant_method": "gptq", "bits": 4}})
    elif change == "e5m2":
        _rewrite(path, config | {"quantization_config": config["quantization_config"] | {"fmt": "e5m2"}})
    elif change == "missing scale":
        _rewrite(path, None, **{layer + "weight_scale_inv": None})
    elif change == "scale shape":
        _rewrite(path, None, **{layer + "weight_scale_inv": torch.ones(2, 1)})
    elif change == "nan scale":
        _rewrite(path, None, **{layer + "weight_scale_inv": torch.full((1, 1), float("nan"))})
    elif change == "huge scale":  # 2^8 times it would overflow a kernel's float32 on the way
        _rewrite(path, None, **{layer + "weight_scale_inv": torch.full((1, 1), 1e37)})
    else:
        _rewrite(path, None, **{"model__norm__weight_scale_inv": torch.ones(1, 1)})
    with pytest.raises(CheckpointError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_checkpoint(str(path))
