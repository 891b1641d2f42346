"""The native Qwen3.5 model (dense and MoE; Gated DeltaNet and gated attention) against transformers, through
Model.forward with explicit state slots: logits, greedy ids, batching, chunking, saved states and GGUF files."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("pocketllm_cpp._native")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pocketllm.checkpoint import load_checkpoint  # noqa: E402
from pocketllm_cpp import _native, kernels  # noqa: E402
from pocketllm_cpp.model import build_model  # noqa: E402
from tests.cpp.slices import forward  # noqa: E402
from tests.torch.qwen3_5_kit import IRREGULAR_LAYERS, tiny_qwen3_5, to_gguf  # noqa: E402
from tests.torch.torch_testkit import hf_greedy, prompt  # noqa: E402

BLOCK = 4  # small blocks: every prompt spans several
BLOCKS = 128
TABLES = [list(range(0, 40)), list(range(80, 40, -1)), list(range(81, 121))]  # 160 positions each, disjoint
KINDS = {"dense": {}, "moe": {"moe": True}, "wrapped": {"wrapped": True}}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """kind -> (transformers model, checkpoint directory), made once."""
    made = {}

    def get(kind: str):
        if kind not in made:
            # A shared expert of 64: the kernels take input sizes in multiples of 32.
            made[kind] = tiny_qwen3_5(tmp_path_factory.mktemp(kind) / "hf", shared_expert_ff=64, **KINDS[kind])
        return made[kind]
    return get


def model_of(path, *, slots: int = 3):
    return build_model(load_checkpoint(str(path)), num_blocks=BLOCKS, block_size=BLOCK, num_threads=2,
                       exact_activations=True, kv_cache_dtype="float32", num_state_slots=slots)


def hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def greedy(model, ids: list[int], steps: int, slot: int = 0) -> list[int]:
    """Greedy ids, feeding each argmax back through forward one token at a time."""
    logits = forward(model, ids, [(0, len(ids), TABLES[slot], 1)], [slot])
    out = [int(np.argmax(logits[-1]))]
    for _ in range(steps - 1):
        logits = forward(model, [out[-1]], [(len(ids) + len(out) - 1, 1, TABLES[slot], 1)], [slot])
        out.append(int(np.argmax(logits[-1])))
    return out


@pytest.mark.parametrize("kind", list(KINDS))
def test_prefill_logits_match_transformers(tiny, kind: str) -> None:
    hf, path = tiny(kind)
    ids = prompt(40, offset=3)
    got = forward(model_of(path), ids, [(0, len(ids), TABLES[0], len(ids))], [0])
    np.testing.assert_allclose(got, hf_logits(hf, ids), atol=1e-3, rtol=0)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_ids_match_transformers_for_64_tokens(tiny, kind: str) -> None:
    hf, path = tiny(kind)
    ids = prompt(9, offset=1)
    assert greedy(model_of(path), ids, 64) == hf_greedy(hf, ids, 64)


def test_a_sequence_batched_is_the_same_bits_as_alone(tiny) -> None:
    _, path = tiny("moe")
    prompts = [prompt(23, offset=2), prompt(7, offset=5), prompt(70, offset=9)]
    alone = []
    for i, ids in enumerate(prompts):
        model = model_of(path)
        steps = [forward(model, ids, [(0, len(ids), TABLES[i], 2)], [i])]
        steps.append(forward(model, [5], [(len(ids), 1, TABLES[i], 1)], [i]))
        alone.append(steps)
    model = model_of(path)
    first = forward(model, [t for p in prompts for t in p], [(0, len(p), TABLES[i], 2) for i, p in enumerate(prompts)],
                          [0, 1, 2])
    second = forward(model, [5, 5, 5], [(len(p), 1, TABLES[i], 1) for i, p in enumerate(prompts)], [0, 1, 2])
    for i in range(3):
        np.testing.assert_array_equal(first[2 * i:2 * i + 2], alone[i][0])
        np.testing.assert_array_equal(second[i:i + 1], alone[i][1])


def test_a_chunked_prefill_is_the_same_bits_as_one_shot(tiny) -> None:
    _, path = tiny("dense")
    ids = prompt(90, offset=4)
    one_shot = forward(model_of(path), ids, [(0, len(ids), TABLES[1], 1)], [1])
    model = model_of(path)
    for start in range(0, 80, 16):
        forward(model, ids[start:start + 16], [(start, 16, TABLES[1], 1)], [1])
    np.testing.assert_array_equal(forward(model, ids[80:], [(80, 10, TABLES[1], 1)], [1]), one_shot)


@pytest.mark.parametrize("isa", kernels.available_isas().split())
def test_the_chunked_delta_rule_is_the_recurrence_under_every_isa(tiny, isa: str) -> None:
    """A 70-token prompt runs the delta rule four chunks at a time and the rest token by token; with prompt_end 0
    every token runs alone (as decode runs them). Both agree with each other and with transformers, under each ISA's
    kernels."""
    hf, path = tiny("dense")
    ids = prompt(70, offset=8)
    kernels.set_isa(isa)
    try:
        def run(prompt_end: int) -> np.ndarray:
            part = _native.SequenceSlice(0, len(ids), TABLES[0], len(ids), state_slot=0, prompt_end=prompt_end)
            return model_of(path).forward(ids, [part])
        chunked, recurrent = run(-1), run(0)
    finally:
        kernels.set_isa("auto")
    assert not np.array_equal(chunked, recurrent)  # the two forms did run
    np.testing.assert_allclose(chunked, recurrent, atol=1e-4, rtol=0)
    np.testing.assert_allclose(chunked, hf_logits(hf, ids), atol=1e-3, rtol=0)


def test_a_state_saved_and_loaded_into_another_slot_resumes_the_sequence(tiny) -> None:
    _, path = tiny("dense")
    ids = prompt(30, offset=6)
    model = model_of(path)
    forward(model, ids, [(0, len(ids), TABLES[0], 1)], [0])
    saved = model.save_state(0)
    assert saved.size * 4 == model.state_bytes > 0 and model.num_state_slots == 3
    model.load_state(2, saved.reshape(-1))
    # Slot 2 over the same KV blocks continues exactly as slot 0 does.
    resumed = forward(model, [7], [(len(ids), 1, TABLES[0], 1)], [2])
    continued = forward(model, [7], [(len(ids), 1, TABLES[0], 1)], [0])
    np.testing.assert_array_equal(resumed, continued)
    with pytest.raises(ValueError, match="state slot"):
        forward(model, [7], [(len(ids), 1, TABLES[0], 1)], [3])
    with pytest.raises(ValueError, match="floats"):
        model.load_state(1, saved.reshape(-1)[:-1])


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_gguf_files_match_transformers(tiny, tmp_path, kind: str) -> None:
    """llama.cpp's layout (norms as 1 + w, -exp(A_log), value heads tiled, experts stacked, an MTP layer beside)."""
    hf, _ = tiny(kind)
    path = to_gguf(hf, tmp_path / "model.gguf", mtp_layers=1)
    ids = prompt(40, offset=3)
    got = forward(model_of(path), ids, [(0, len(ids), TABLES[0], len(ids))], [0])
    np.testing.assert_allclose(got, hf_logits(hf, ids), atol=1e-3, rtol=0)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_q8_0_gguf_files_read_in_place_match_their_dequantized_values(tiny, tmp_path, monkeypatch, kind: str) -> None:
    from pocketllm_cpp import loading

    hf, _ = tiny(kind)
    path = to_gguf(hf, tmp_path / "q8.gguf", matrices="Q8_0")
    ids = prompt(40, offset=3)
    kept = forward(model_of(path), ids, [(0, len(ids), TABLES[0], len(ids))], [0])
    monkeypatch.setattr(loading, "STORAGE_TYPES", ("F32",))  # every Q8_0 matrix as a float32 copy
    dequantized = forward(model_of(path), ids, [(0, len(ids), TABLES[0], len(ids))], [0])
    np.testing.assert_allclose(kept, dequantized, atol=1e-3, rtol=0)
    if kind == "dense":  # in the MoE, rounding flips some routing choices: far apart, rightly
        reference = hf_logits(hf, ids)
        # A misread tensor is off by the logits' whole range; 8-bit rounding through 4 random layers, by ~9% of it.
        assert np.abs(kept - reference).max() <= 0.15 * (reference.max() - reference.min())


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gguf_files_of_llama_cpp_s_own_converter_match_transformers(tmp_path, llama_cpp, moe: bool) -> None:
    from tests.torch.qwen3_5_kit import convert_with_llama_cpp

    hf, path = tiny_qwen3_5(tmp_path / "hf", moe=moe, layer_types=IRREGULAR_LAYERS, shared_expert_ff=64)
    gguf = convert_with_llama_cpp(llama_cpp, path, tmp_path / "model.gguf")
    ids = prompt(40, offset=3)
    got = forward(model_of(gguf), ids, [(0, len(ids), TABLES[0], len(ids))], [0])
    np.testing.assert_allclose(got, hf_logits(hf, ids), atol=1e-3, rtol=0)
    assert greedy(model_of(gguf), ids[:5], 16) == hf_greedy(hf, ids[:5], 16)


def test_a_checkpoint_missing_a_tensor_is_refused_with_a_checkpoint_error(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    from pocketllm.errors import CheckpointError

    _, path = tiny_qwen3_5(tmp_path / "hf")
    weights = load_file(path / "model.safetensors")
    del weights["model.layers.0.linear_attn.dt_bias"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="dt_bias"):
        model_of(path)


def test_state_slots_are_checked_before_any_work(tiny) -> None:
    _, path = tiny("dense")
    with pytest.raises(ValueError, match="state slot"):
        forward(model_of(path), [1, 2], [(0, 2, TABLES[0], 1)], [5])
