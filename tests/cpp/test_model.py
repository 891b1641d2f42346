"""The native Llama/Qwen3 forward pass against transformers' references (the conformance kit's checkpoints)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pocketllm_cpp._native")

from pocketllm.checkpoint import load_checkpoint
from pocketllm.testing import checkpoints, references
from pocketllm_cpp import kernels
from pocketllm_cpp.model import build_model as _build_model
from tests.cpp.slices import forward

REFERENCES = references.load()
BLOCK = 4  # small blocks: every prompt spans several, in a shuffled table


def build_model(checkpoint, **kwargs):
    """The model with a float32 KV cache unless a test asks otherwise: the references are float32 arithmetic."""
    return _build_model(checkpoint, **{"kv_cache_dtype": "float32", **kwargs})


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def _greedy(model, prompts: list[list[int]], steps: int, tables: list[list[int]]) -> list[list[np.ndarray]]:
    """Greedy decoding of every prompt in one batch per step; each sequence's logprobs, step by step."""
    slices = [(0, len(p), t, True) for p, t in zip(prompts, tables, strict=True)]
    tokens = [t for p in prompts for t in p]
    lengths = [len(p) for p in prompts]
    out: list[list[np.ndarray]] = [[] for _ in prompts]
    for _ in range(steps):
        logits = forward(model, tokens, slices)
        tokens = []
        for i, row in enumerate(logits):
            out[i].append(_log_softmax(row))
            tokens.append(int(np.argmax(row)))
        slices = [(lengths[i] + len(out[i]) - 1, 1, tables[i], True) for i in range(len(prompts))]
    return out


def _tables(count: int, per_sequence: int) -> list[list[int]]:
    blocks = np.random.default_rng(0).permutation(count * per_sequence)
    return [blocks[i::count].tolist() for i in range(count)]


@pytest.fixture(params=kernels.available_isas().split())
def isa(request: pytest.FixtureRequest):
    kernels.set_isa(request.param)
    yield request.param
    kernels.set_isa("auto")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_float32_checkpoints_match_transformers_batched(kind: str, isa: str, pocketllm_kit_checkpoint) -> None:
    model = build_model(load_checkpoint(str(pocketllm_kit_checkpoint(kind))), num_blocks=200, block_size=BLOCK,
                        num_threads=2)
    refs = REFERENCES.checkpoints[kind].references
    steps = REFERENCES.max_tokens
    runs = _greedy(model, [r.prompt for r in refs], steps, _tables(len(refs), 200 // len(refs)))
    for ref, logprobs in zip(refs, runs, strict=True):
        assert [int(np.argmax(lp)) for lp in logprobs] == ref.token_ids
        for lp, top in zip(logprobs, ref.top_logprobs, strict=True):
            ours = np.sort(lp)[::-1][:len(top)]
            assert np.abs(ours - [v for _, v in top]).max() <= 1e-3  # issue 13's fidelity target


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_half_precision_kv_cache_stays_close(kind: str, isa: str, pocketllm_kit_checkpoint) -> None:
    """The default float16 KV cache: transformers' greedy ids, and logprobs within 5e-2 (half's 11-bit mantissa on
    the kit's large random keys and values moves them by up to ~3e-2 by the last step; the float32 cache is the
    option for the 1e-3 target)."""
    model = build_model(load_checkpoint(str(pocketllm_kit_checkpoint(kind))), num_blocks=200, block_size=BLOCK,
                        num_threads=2, kv_cache_dtype="float16")
    refs = REFERENCES.checkpoints[kind].references
    runs = _greedy(model, [r.prompt for r in refs], REFERENCES.max_tokens, _tables(len(refs), 200 // len(refs)))
    for ref, logprobs in zip(refs, runs, strict=True):
        assert [int(np.argmax(lp)) for lp in logprobs] == ref.token_ids
        for lp, top in zip(logprobs, ref.top_logprobs, strict=True):
            assert np.abs(np.sort(lp)[::-1][:len(top)] - [v for _, v in top]).max() <= 5e-2


def test_llama_gguf_rows_as_llama_cpp_stores_them(pocketllm_kit_checkpoint, tmp_path, monkeypatch) -> None:
    """Permuted q/k rows are run with RoPE over adjacent pairs, unpermuted: float32 blocks match transformers."""
    monkeypatch.setattr(checkpoints, "GGUF_STORAGE_TYPES", dict.fromkeys(checkpoints.GGUF_STORAGE_TYPES, "F32"))
    path = checkpoints.make_tiny_gguf(tmp_path / "f32.gguf")
    checkpoint = load_checkpoint(str(path))
    assert any(t.row_permutation is not None for t in checkpoint.tensors())
    model = build_model(checkpoint, num_blocks=64, block_size=BLOCK, num_threads=2)
    ref = REFERENCES.checkpoints["llama"].references[2]
    [run] = _greedy(model, [ref.prompt], REFERENCES.max_tokens, _tables(1, 64))
    assert [int(np.argmax(lp)) for lp in run] == ref.token_ids


def test_quantized_gguf_with_exact_activations_matches_transformers(isa: str, pocketllm_kit_checkpoint) -> None:
    """Q8_0/Q4_0/Q4_1/F16 blocks read in place with float32 activations: transformers' greedy ids over the same
    dequantized weights, and its logprobs within 1e-3."""
    model = build_model(load_checkpoint(str(pocketllm_kit_checkpoint("llama-gguf"))), num_blocks=120,
                        block_size=BLOCK, num_threads=2, exact_activations=True)
    refs = REFERENCES.checkpoints["llama-gguf"].references
    runs = _greedy(model, [r.prompt for r in refs], REFERENCES.max_tokens, _tables(len(refs), 120 // len(refs)))
    for ref, logprobs in zip(refs, runs, strict=True):
        assert [int(np.argmax(lp)) for lp in logprobs] == ref.token_ids
        assert abs(logprobs[0].max() - ref.top_logprobs[0][0][1]) <= 1e-3


def test_quantized_gguf_with_8bit_activations_is_close(pocketllm_kit_checkpoint) -> None:
    """8-bit activations (llama.cpp's arithmetic): the first token agrees. The kit's random weights, large for
    clear margins, make 8-bit rounding visible (up to ~0.4 in a logprob), so the full kit needs exact mode."""
    model = build_model(load_checkpoint(str(pocketllm_kit_checkpoint("llama-gguf"))), num_blocks=64,
                        block_size=BLOCK, num_threads=2)
    for ref in REFERENCES.checkpoints["llama-gguf"].references:
        [first] = _greedy(model, [ref.prompt], 1, _tables(1, 64))[0]
        assert int(np.argmax(first)) == ref.token_ids[0]


@pytest.mark.parametrize("kind", ["llama-gguf", "qwen3"])
def test_a_sequence_is_the_same_bits_alone_and_batched(kind: str, isa: str, pocketllm_kit_checkpoint) -> None:
    """A sequence's logits do not depend on what shares its steps: alone (its prompt in one slice, then a token a
    step, attention's parts spread over the threads) and batched (its prompt in two chunks beside other prompts
    and decodes, one of them joining later: one work item per attention job), bit for bit. Its 150 positions
    span three attention parts; the GGUF's blocks take the batched kernels' tiles."""
    model = build_model(load_checkpoint(str(pocketllm_kit_checkpoint(kind))), num_blocks=500, block_size=BLOCK,
                        num_threads=2, kv_cache_dtype="float16")
    rng = np.random.default_rng(10)
    prompt, others = rng.integers(3, 323, 150).tolist(), [rng.integers(3, 323, n).tolist() for n in (40, 20, 60)]
    table, *tables = _tables(5, 100)
    alone = [forward(model, prompt, [(0, 150, table, True)])[0]]
    for step in range(5):
        token = int(np.argmax(alone[-1]))
        alone.append(forward(model, [token], [(150 + step, 1, table, True)])[0])
    table = tables.pop(0)
    # Step 1: another prompt and the first chunk of ours; step 2: the rest of ours, a decode and a new prompt.
    forward(model, others[0] + prompt[:37], [(0, 40, tables[0], True), (0, 37, table, False)])
    logits = forward(model, prompt[37:] + [5] + others[1], [(37, 113, table, True), (40, 1, tables[0], True),
                                                          (0, 20, tables[1], True)])
    batched = [logits[0]]
    for step in range(5):
        token = int(np.argmax(alone[step]))  # the tokens the lone run fed, so that the caches agree
        tokens, slices = [token, 7, 9], [(150 + step, 1, table, True), (41 + step, 1, tables[0], True),
                                         (20 + step, 1, tables[1], True)]
        if step == 2:  # a prompt joins mid-way
            tokens, slices = tokens + others[2], [*slices, (0, 60, tables[2], True)]
        batched.append(forward(model, tokens, slices)[0])
    for ours, reference in zip(batched, alone, strict=True):
        np.testing.assert_array_equal(ours, reference)


def test_bad_slices_raise_value_error(pocketllm_kit_checkpoint) -> None:
    model = build_model(load_checkpoint(str(pocketllm_kit_checkpoint("llama"))), num_blocks=4, block_size=BLOCK,
                        num_threads=1)
    for tokens, slices, message in [
        ([5, 6], [(0, 2, [0], True)], None),
        ([5, 10**6], [(0, 2, [0], True)], "token id"),
        ([5, -1], [(0, 2, [0], True)], "token id"),
        ([5] * 9, [(0, 9, [0, 1], True)], "too short"),
        ([5], [(0, 1, [7], True)], "out of range"),
        ([5], [(0, 1, [-1], True)], "out of range"),
        ([5, 6], [(0, 1, [0], True)], "cover"),
        ([5], [(-3, 1, [0], True)], "start"),
    ]:
        if message is None:
            assert forward(model, tokens, slices).shape == (1, 323)
        else:
            with pytest.raises(ValueError, match=message):
                forward(model, tokens, slices)


@pytest.mark.parametrize("damage", ["cut", "offset", "dims"])
def test_corrupt_gguf_is_a_checkpoint_error_on_the_cpp_backend(damage: str, pocketllm_kit_checkpoint, tmp_path,
                                                               monkeypatch) -> None:
    """The core's reader refuses a broken file before the native code sees a byte of it, on any ISA."""
    import struct

    import gguf

    from pocketllm import LLM, CheckpointError

    monkeypatch.setenv("POCKETLLM_CPP_ISA", "scalar")
    source = pocketllm_kit_checkpoint("llama-gguf")
    data = bytearray(source.read_bytes())
    reader = gguf.GGUFReader(source)
    parts = reader.tensors[-1].field.parts
    if damage == "cut":
        data = data[:len(data) // 2]
    elif damage == "offset":
        struct.pack_into("<Q", data, parts[-1].ctypes.data - reader.data.ctypes.data, 2**40)
    else:
        struct.pack_into("<Q", data, parts[3].ctypes.data - reader.data.ctypes.data, 2**33)
    path = tmp_path / "broken.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"broken\.gguf"):
        LLM(str(path), backend="cpp").shutdown()


def test_an_eos_id_outside_the_vocabulary_fails_the_load(pocketllm_kit_checkpoint, tmp_path, monkeypatch) -> None:
    """An EOS id of 2^32 - 1 (a mutated GGUF): a CheckpointError naming the file and the field at load, where every
    request used to fail with std::bad_cast while /health said ok."""
    from pocketllm import LLM, CheckpointError

    monkeypatch.setattr(checkpoints, "EOS_TOKEN_ID", 2**32 - 1)
    path = checkpoints.make_tiny_gguf(tmp_path / "eos.gguf")
    with pytest.raises(CheckpointError, match=r"eos\.gguf.*eos_token_id"):
        LLM(str(path), backend="cpp").shutdown()


def test_native_arguments_are_typed_and_checked(pocketllm_kit_checkpoint) -> None:
    """What the native module is given is typed (a value that does not convert is a TypeError as it is set, never
    std::bad_cast later) and checked there too (a ValueError)."""
    from pocketllm_cpp import _native

    model = build_model(load_checkpoint(str(pocketllm_kit_checkpoint("llama"))), num_blocks=8, block_size=BLOCK,
                        num_threads=1)
    engine = _native.Engine(model, 2, 16, 16, 0)
    sampling = _native.SamplingConfig()
    for field, value in [("stop_ids", [2**32 - 1]), ("logit_bias", {2**40: 1.0}), ("temperature", "hot"),
                         ("seed", 2**70), ("max_tokens", None)]:
        with pytest.raises(TypeError, match="incompatible function arguments"):
            setattr(sampling, field, value)
    sampling.stop_ids = [10**6]
    with pytest.raises(ValueError, match=r"token id out of range"):
        engine.add_request("a", [5, 6], sampling)
    with pytest.raises(TypeError):
        engine.add_request("a", [5, 6], {"max_tokens": 2})  # a dict is not a SamplingConfig
    with pytest.raises(TypeError, match=r"must be a pocketllm_cpp\._native\.Model"):
        _native.Engine(object(), 2, 16, 16, 0)
    assert not engine.has_unfinished()


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
    {"rope_type": "linear", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "attention_factor": 1.3,
     "beta_fast": 16, "beta_slow": 2},
], ids=["llama3", "linear", "yarn", "yarn-explicit"])
def test_rope_scaling_matches_transformers(scaling: dict, backend: str, pocketllm_kit_checkpoint, tmp_path) -> None:
    """Both backends share pocketllm.rope: each generates transformers' greedy tokens past the original context."""
    import json
    import shutil

    from pocketllm import LLM, SamplingParams

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip(f"pocketllm_{backend}")
    path = tmp_path / "scaled"
    shutil.copytree(pocketllm_kit_checkpoint("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))
    prompt = REFERENCES.checkpoints["llama"].references[4].prompt  # 22 tokens: past the 16 original positions
    reference = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(path), backend=backend, dtype="float32", kv_cache_dtype="float32")
    try:
        [out] = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == expected
    unscaled = REFERENCES.checkpoints["llama"].references[4].token_ids[:12]
    assert expected != unscaled  # the scaling changed the output: the test can tell scaled from not


def test_unknown_rope_scaling_is_refused(pocketllm_kit_checkpoint, tmp_path) -> None:
    import json
    import shutil

    from pocketllm import LLM, UnsupportedOptionError

    path = tmp_path / "longrope"
    shutil.copytree(pocketllm_kit_checkpoint("llama"), path)
    config = json.loads((path / "config.json").read_text())
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    (path / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))
    with pytest.raises(UnsupportedOptionError) as err:
        LLM(str(path), backend="cpp")
    assert (err.value.option, err.value.backend) == ("rope_scaling", "cpp")


@pytest.mark.parametrize("backend", ["cpp", "torch"])
@pytest.mark.parametrize(("option", "value"), [("num_threads", 10**6), ("num_kv_blocks", 10**12), ("num_threads", 0),
                                               ("block_size", 10**9)])
def test_absurd_backend_options_are_config_errors(backend: str, option: str, value: int,
                                                  pocketllm_kit_checkpoint) -> None:
    """Backend options are the user's: a typo must be a ConfigError, not a million threads or a MemoryError."""
    from pocketllm import LLM, ConfigError

    pytest.importorskip(f"pocketllm_{backend}")
    with pytest.raises(ConfigError) as err:
        LLM(str(pocketllm_kit_checkpoint("llama")), backend=backend, dtype="float32",
            backend_options={option: value}).shutdown()
    assert err.value.field in ("backend_options", f"backend_options.{option}") and str(value) in str(err.value)


def test_a_slice_yields_the_logits_of_its_last_tokens(pocketllm_kit_checkpoint) -> None:
    """num_logits rows for a slice's last tokens (what speculative decoding verifies) are the logits each of those
    tokens gets when it is run a step at a time, bit for bit; 0..num_tokens is the range."""
    model = build_model(load_checkpoint(str(pocketllm_kit_checkpoint("qwen3"))), num_blocks=100, block_size=BLOCK,
                        num_threads=2, kv_cache_dtype="float16")
    prompt = np.random.default_rng(3).integers(3, 323, 40).tolist()
    first, second = _tables(2, 50)
    rows = forward(model, prompt, [(0, 40, first, 5)])
    assert rows.shape == (5, 323)
    stepwise = [forward(model, prompt[:36], [(0, 36, second, 1)])[0]]
    stepwise += [forward(model, [token], [(36 + i, 1, second, 1)])[0] for i, token in enumerate(prompt[36:39])]
    np.testing.assert_array_equal(rows[:4], np.stack(stepwise))
    for bad in (-1, 41):
        with pytest.raises(ValueError, match="num_logits"):
            forward(model, prompt, [(0, 40, first, bad)])
