"""Qwen3.5 (hybrid Gated DeltaNet + gated attention, dense and MoE) against transformers on tiny random fp32
checkpoints: logits of a batched prefill, then greedy ids through the engine under batching, chunked prefill,
token budgets, preemption and aborts, with every block and state slot returned."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from pocketllm.checkpoint import load_checkpoint
from pocketllm_torch.attention import KVCache, build_metadata
from pocketllm_torch.cache_spec import AttentionSpec, StateSpec
from pocketllm_torch.context import StepContext
from pocketllm_torch.models import model_class
from pocketllm_torch.state_cache import StateCache
from tests.torch.qwen3_5_kit import IRREGULAR_LAYERS, tiny_qwen3_5, to_gguf
from tests.torch.torch_testkit import add, greedy, hf_greedy, make_engine, prompt, run_to_completion

CPU = torch.device("cpu")
KINDS = {"dense": {}, "moe": {"moe": True}, "wrapped": {"wrapped": True}, "moe-wrapped": {"moe": True, "wrapped": True}}
LENGTHS = (3, 17, 70, 130)  # across the delta rule's 64-token chunks


@pytest.fixture(scope="module", params=list(KINDS))
def qwen(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(transformers model, checkpoint, its greedy 32 ids for prompts of several lengths)."""
    hf, path = tiny_qwen3_5(tmp_path_factory.mktemp(request.param), **KINDS[request.param])
    reference = {n: hf_greedy(hf, prompt(n, offset=n), 32) for n in LENGTHS}
    return hf, load_checkpoint(str(path)), reference


def test_checkpoint_forms_load_as_the_text_model(qwen) -> None:
    _, checkpoint, _ = qwen
    assert checkpoint.config.architecture in ("qwen3_5_text", "qwen3_5_moe_text")
    names = {t.name for t in checkpoint.tensors()}
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in names and "lm_head.weight" in names
    assert not any(n.startswith(("model.visual", "model.language_model", "mtp.")) for n in names)


def test_logits_match_transformers(qwen) -> None:
    hf, checkpoint, _ = qwen
    config = checkpoint.config
    model = model_class(config.architecture).from_weights(
        config, ((t.name, t.dequantize()) for t in checkpoint.tensors()), CPU, torch.float32, 256)
    prompts = [prompt(37), prompt(5, offset=1), prompt(90, offset=2)]
    specs = model.cache_specs
    attention = [s for s in specs if isinstance(s, AttentionSpec)]
    states = [s for s in specs if isinstance(s, StateSpec)]
    assert len(attention) == 1 and len(states) == 3  # three Gated DeltaNet layers to one attention layer
    kv = KVCache(len(attention), 200, 4, config.num_key_value_heads, config.head_dim, torch.float32, CPU)
    state = StateCache(len(states), 5, states[0], torch.float32, CPU)
    state.conv.fill_(float("nan"))  # what torch.empty may hand back: reset must clear it
    state.recurrent.fill_(float("nan"))
    slots = torch.tensor([4, 0, 2])
    state.reset(slots)
    layers_kv, layers_state = iter(kv.layers), iter(state.layers)
    caches = [next(layers_kv) if isinstance(s, AttentionSpec) else next(layers_state) for s in specs]
    tables = [list(range(1 + i, 200, 3))[::-1] for i in range(3)]
    kv.zero_new_blocks(tables)
    positions, meta = build_metadata([0] * 3, [len(p) for p in prompts], tables, 4, CPU, torch.float32)
    with torch.inference_mode():
        ctx = StepContext(positions, meta, caches, [len(p) for p in prompts], slots)
        logits = model.compute_logits(model(torch.tensor([t for p in prompts for t in p]), ctx))
    for ids, ours in zip(prompts, logits.split([len(p) for p in prompts]), strict=True):
        with torch.no_grad():
            reference = hf(torch.tensor([ids])).logits[0]
        assert (ours - reference).abs().max().item() <= 1e-3


@pytest.mark.parametrize("engine_args", [
    {},
    {"prefill_chunk_size": 7},
    {"prefill_chunk_size": 16},
    {"prefill_chunk_size": 50},
    {"max_num_batched_tokens": 20, "prefill_chunk_size": 16},
    {"max_num_seqs": 2},
    {"backend_options": {"block_size": 4, "num_kv_blocks": 70}},  # too few blocks for all four: preemption
], ids=["batched", "chunk-7", "chunk-16", "chunk-50", "token-budget", "queued", "preempted"])
def test_greedy_ids_match_transformers(qwen, engine_args: dict) -> None:
    _, checkpoint, reference = qwen
    engine = make_engine(checkpoint, max_model_len=256, **engine_args)
    outputs = run_to_completion(engine, {str(n): (prompt(n, offset=n), greedy(32)) for n in reference})
    assert outputs == {str(n): ids for n, ids in reference.items()}
    stats = engine.stats()
    assert (stats.num_kv_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)
    assert engine.state_slots is not None and engine.state_slots.num_used == 0
    if "num_kv_blocks" in engine_args.get("backend_options", {}):
        assert stats.num_preemptions > 0


def test_alone_equals_batched(qwen) -> None:
    _, checkpoint, reference = qwen
    for n, ids in reference.items():
        engine = make_engine(checkpoint, max_model_len=256)
        assert run_to_completion(engine, {"alone": (prompt(n, offset=n), greedy(32))}) == {"alone": ids}


def test_abort_frees_blocks_and_state_slots(qwen) -> None:
    _, checkpoint, reference = qwen
    engine = make_engine(checkpoint, max_model_len=256, max_num_seqs=2)
    for n in reference:
        add(engine, str(n), prompt(n, offset=n), greedy(32))
    outputs: dict[str, list[int]] = {str(n): [] for n in reference}

    def step() -> None:
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids

    for _ in range(3):
        step()
    assert engine.state_slots is not None and engine.state_slots.num_used == 2
    engine.abort(["3", "130"])  # one running, one still waiting
    while engine.has_unfinished():
        step()
    assert (outputs["17"], outputs["70"], outputs["130"]) == (reference[17], reference[70], [])
    assert engine.state_slots.num_used == 0 and engine.stats().num_kv_blocks_used == 0


@pytest.mark.parametrize(("engine_args", "resumed_at"), [
    ({}, 64),  # a snapshot inside the first request's one prompt chunk, after 64 tokens of the delta rule
    ({"prefill_chunk_size": 24}, 48),  # at the end of its chunks (24, 48, then 72: past the shared 70)
    ({"max_num_seqs": 1}, 64),
], ids=["one-chunk", "chunked", "one-at-a-time"])
def test_prefix_cached_equals_cold_and_hits(qwen, engine_args: dict, resumed_at: int) -> None:
    """Requests sharing a 70-token prefix (8 full blocks of 8): the later ones resume from the attention blocks
    and the state snapshot at the deepest block boundary that has both, and generate what transformers does from
    scratch."""
    hf, checkpoint, _ = qwen
    shared = prompt(70, offset=9)
    prompts = {f"q{i}": shared + prompt(5 + 3 * i, offset=20 + i) for i in range(3)}
    expected = {rid: hf_greedy(hf, ids, 16) for rid, ids in prompts.items()}
    engine = make_engine(checkpoint, max_model_len=256, enable_prefix_caching=True,
                         backend_options={"block_size": 8}, **engine_args)
    assert run_to_completion(engine, {"q0": (prompts["q0"], greedy(16))}) == {"q0": expected["q0"]}
    rest = {rid: (ids, greedy(16)) for rid, ids in prompts.items() if rid != "q0"}
    assert run_to_completion(engine, rest) == {rid: expected[rid] for rid in rest}
    stats = engine.stats()
    assert stats.num_state_snapshot_hits == 2 and stats.num_state_snapshots > 0
    assert stats.num_prefix_cache_hits == 2 * resumed_at
    assert engine.state_slots is not None and engine.state_slots.num_used == 0
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    # Cached blocks are free to evict: none is held by a request.
    assert stats.num_kv_blocks_used == 0


def test_snapshots_are_evicted_least_recently_used_under_their_budget(qwen) -> None:
    _, checkpoint, _ = qwen
    engine = make_engine(checkpoint, max_model_len=256, enable_prefix_caching=True, prefill_chunk_size=8,
                         backend_options={"block_size": 8, "state_snapshot_mb": 1})
    capacity = engine.runner.snapshots.capacity  # 1 MiB of this model's ~17 KB snapshots
    prompts = {f"r{i}": prompt(200, offset=40 + i) for i in range(3)}
    run_to_completion(engine, {rid: (ids, greedy(2)) for rid, ids in prompts.items()})
    stats = engine.stats()
    taken = 3 * (200 // 8)  # one at each block boundary of each prompt, its end included: chunks end there
    assert capacity < taken and stats.num_state_snapshots == capacity
    assert stats.num_state_snapshot_evictions == taken - capacity
    # The latest prompt's snapshots are the most recently used: a request repeating it resumes from its last.
    run_to_completion(engine, {"again": (prompts["r2"] + [5], greedy(2))})
    assert engine.stats().num_state_snapshot_hits == 1 and engine.stats().num_prefix_cache_hits == 200


def test_a_shared_prefix_snapshot_outlives_a_flood_of_one_off_prompts(qwen) -> None:
    # Snapshots requests resumed from are evicted after those none did (state_snapshots.py): under plain LRU the 75
    # snapshots of three new prompts would push out the shared prefix's, and the last request would start cold.
    _, checkpoint, _ = qwen
    engine = make_engine(checkpoint, max_model_len=256, enable_prefix_caching=True, prefill_chunk_size=8,
                         backend_options={"block_size": 8, "state_snapshot_mb": 1})
    shared = prompt(64, offset=7)
    run_to_completion(engine, {"first": ([*shared, 3], greedy(2))})
    run_to_completion(engine, {"second": ([*shared, 4], greedy(2))})  # resumes from the prefix's snapshot at 64
    assert engine.stats().num_state_snapshot_hits == 1
    flood = {f"r{i}": (prompt(200, offset=40 + i), greedy(2)) for i in range(3)}
    run_to_completion(engine, flood)
    assert engine.runner.snapshots.capacity < 3 * (200 // 8)  # the flood alone overfills the budget
    run_to_completion(engine, {"third": ([*shared, 5], greedy(2))})
    assert engine.stats().num_state_snapshot_hits == 2


def test_snapshot_eviction_keeps_resumed_snapshots_and_room_for_new_ones() -> None:
    from types import SimpleNamespace

    from pocketllm_torch.state_snapshots import StateSnapshots

    snapshots = StateSnapshots(capacity=8)
    cache = SimpleNamespace(conv=torch.zeros(1, 1), recurrent=torch.zeros(1, 1))
    state = torch.zeros(1), torch.zeros(1)
    snapshots.save(1, *state)
    snapshots.save(2, *state)
    snapshots.restore(1, cache, 0)  # a shared prefix's snapshot, resumed from
    for key in range(10, 40):  # 30 one-off prompt ends
        snapshots.save(key, *state)
    assert 1 in snapshots and 2 not in snapshots and 39 in snapshots and len(snapshots) == 8
    assert snapshots.num_evictions == 24
    for key in range(1, 8):  # resumed snapshots keep at most 6 of the 8 places
        if key not in snapshots:
            snapshots.save(key, *state)
        snapshots.restore(key, cache, 0)
    assert 1 in snapshots  # the oldest resumed went back on probation, as its newest
    snapshots.save(50, *state)  # evicts 39
    snapshots.save(51, *state)  # evicts 1
    assert 1 not in snapshots and 50 in snapshots and 51 in snapshots
    assert all(key in snapshots for key in range(2, 8)) and len(snapshots) == 8


def test_a_config_that_disagrees_with_the_gated_deltanet_tensors_is_refused_at_load(tmp_path) -> None:
    import json

    from pocketllm.errors import CheckpointError

    _, path = tiny_qwen3_5(tmp_path, layers=4)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"linear_num_value_heads": 8}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.linear_attn\..*linear_num_value_heads"):
        load_checkpoint(str(path))


def test_traced_decode_steps_match_eager_ones(tmp_path) -> None:
    """bf16, where torch's kernels trace: decode steps replayed from traces (state slots an input) generate what
    eager steps do, and a recording leaves the states as it found them."""
    _, path = tiny_qwen3_5(tmp_path)
    checkpoint = load_checkpoint(str(path))
    requests = {f"r{i}": (prompt(3 + 9 * i, offset=i), greedy(6 + 5 * i)) for i in range(4)}
    results, engines = {}, {}
    for on in (False, True):
        engines[on] = make_engine(checkpoint, dtype="bfloat16", max_model_len=256,
                                  backend_options={"decode_graphs": on, "block_size": 4})
        results[on] = run_to_completion(engines[on], requests)
    assert results[True] == results[False]
    assert engines[False].runner.decode_graphs is None
    assert any(trace is not None for trace in engines[True].runner.decode_graphs.traces.values())


@pytest.mark.parametrize("value", [0, -1, 2**64, "4", True, None])
def test_absurd_linear_attention_sizes_are_checkpoint_errors(tmp_path, value) -> None:
    import json

    from pocketllm.errors import CheckpointError

    _, path = tiny_qwen3_5(tmp_path, layers=4)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"linear_num_key_heads": value}))
    with pytest.raises(CheckpointError, match="linear_num_key_heads"):
        make_engine(load_checkpoint(str(path)))


@pytest.mark.parametrize(("moe", "layer_types"), [(False, None), (True, None), (False, IRREGULAR_LAYERS),
                                                  (True, IRREGULAR_LAYERS)],
                         ids=["dense", "moe", "dense-irregular", "moe-irregular"])
def test_gguf_files_of_llama_cpp_s_converter_match_transformers(tmp_path, moe: bool, layer_types) -> None:
    """A GGUF written as llama.cpp's converter writes Qwen3.5 (norms as 1 + w, -exp(A_log), value heads tiled,
    experts split; multi-token-prediction layers after the model's; the layer mix in attention.recurrent_layers,
    full_attention_interval 4 beside it whatever the mix) generates transformers' greedy ids."""
    hf, _ = tiny_qwen3_5(tmp_path / "hf", moe=moe, layer_types=layer_types)
    checkpoint = load_checkpoint(str(to_gguf(hf, tmp_path / "model.gguf", mtp_layers=1)))
    config = checkpoint.config
    layers = len(layer_types or "1234")
    assert (config.architecture, config.num_hidden_layers) == ("qwen3_5_moe_text" if moe else "qwen3_5_text", layers)
    assert config.extra["layer_types"] == hf.config.layer_types
    assert (config.extra["linear_value_head_dim"], config.extra["partial_rotary_factor"]) == (16, 0.25)
    assert not any(t.file_name.startswith(f"blk.{layers}.") for t in checkpoint.tensors())
    requests = {str(n): (prompt(n, offset=n), greedy(32)) for n in (3, 70)}
    expected = {rid: hf_greedy(hf, ids, 32) for rid, (ids, _) in requests.items()}
    assert run_to_completion(make_engine(checkpoint, max_model_len=256, prefill_chunk_size=16), requests) == expected


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gguf_files_of_llama_cpp_s_own_converter_match_transformers(tmp_path, llama_cpp, moe: bool) -> None:
    """Files made by convert_hf_to_gguf.py itself (the llama-cpp-python sdist's vendor/llama.cpp), an irregular
    layer mix and a multi-token-prediction layer in them, generate transformers' greedy ids."""
    from tests.torch.qwen3_5_kit import convert_with_llama_cpp

    hf, path = tiny_qwen3_5(tmp_path / "hf", moe=moe, layer_types=IRREGULAR_LAYERS)
    checkpoint = load_checkpoint(str(convert_with_llama_cpp(llama_cpp, path, tmp_path / "model.gguf")))
    config = checkpoint.config
    assert checkpoint.gguf_metadata[f"{'qwen35moe' if moe else 'qwen35'}.attention.recurrent_layers"] == [
        kind == "linear_attention" for kind in IRREGULAR_LAYERS] + [False]
    assert (config.num_hidden_layers, config.extra["layer_types"]) == (5, IRREGULAR_LAYERS)
    requests = {str(n): (prompt(n, offset=n), greedy(32)) for n in (3, 70)}
    expected = {rid: hf_greedy(hf, ids, 32) for rid, (ids, _) in requests.items()}
    assert run_to_completion(make_engine(checkpoint, max_model_len=256, prefill_chunk_size=16), requests) == expected


def test_quantized_gguf_files_load_and_stay_close(tmp_path) -> None:
    """Q8_0 matrices: kept 8-bit (where the native kernels are built), a prefill's logits equal those of the same
    file dequantized to fp32, and stay near transformers' (the file's own rounding apart); the engine serves it."""
    from pocketllm_torch import groups
    from pocketllm_torch.linear import uses_int8

    hf, _ = tiny_qwen3_5(tmp_path / "hf")
    checkpoint = load_checkpoint(str(to_gguf(hf, tmp_path / "q8.gguf", matrices="Q8_0")))
    assert checkpoint.quantization == "Q8_0"
    config = checkpoint.config
    ids = prompt(40, offset=3)

    def prefill_logits(int8: bool) -> torch.Tensor:
        weights = ((t.name, groups.load(t, groups.GroupFormats(int4=False, int8=int8))) for t in checkpoint.tensors())
        model = model_class(config.architecture).from_weights(config, weights, CPU, torch.float32, 256)
        kv = KVCache(1, 20, 4, config.num_key_value_heads, config.head_dim, torch.float32, CPU)
        state = StateCache(3, 1, model.cache_specs[0], torch.float32, CPU)
        state.reset(torch.tensor([0]))
        layers_kv, layers_state = iter(kv.layers), iter(state.layers)
        caches = [next(layers_kv) if isinstance(s, AttentionSpec) else next(layers_state) for s in model.cache_specs]
        table = list(range(1, 11))
        kv.zero_new_blocks([table])
        positions, meta = build_metadata([0], [len(ids)], [table], 4, CPU, torch.float32)
        with torch.inference_mode():
            ctx = StepContext(positions, meta, caches, [len(ids)], torch.tensor([0]))
            return model.compute_logits(model(torch.tensor(ids), ctx))

    kept = prefill_logits(uses_int8(CPU))
    assert (kept - prefill_logits(False)).abs().max() <= 1e-3
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0]
    # A misread tensor is off by the logits' whole range; 8-bit rounding through 4 random layers, by ~9% of it.
    assert (kept - reference).abs().max() <= 0.15 * (reference.max() - reference.min())
    got = run_to_completion(make_engine(checkpoint, max_model_len=256), {"r": (ids, greedy(8))})["r"]
    assert len(got) == 8


def test_a_gguf_whose_tensors_disagree_with_its_metadata_is_refused_at_load(tmp_path) -> None:
    import gguf

    from pocketllm.errors import CheckpointError

    hf, _ = tiny_qwen3_5(tmp_path / "hf")
    path = to_gguf(hf, tmp_path / "model.gguf")
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields["qwen35.ssm.inner_size"]
    field.parts[field.data[0]][0] = 32  # 2 value heads of 16, not 4
    reader.data.flush()
    with pytest.raises(CheckpointError, match=r"blk\.0\.ssm_conv1d.*qwen35\.ssm\.inner_size"):
        load_checkpoint(str(path))


def test_the_snapshot_budget_comes_out_of_the_kv_cache_s(qwen, monkeypatch) -> None:
    from pocketllm_torch.platform import CpuPlatform
    from pocketllm_torch.state_cache import StateCache

    _, checkpoint, _ = qwen
    probe = make_engine(checkpoint, max_model_len=256, max_num_seqs=2, backend_options={"block_size": 8})
    states = [s for s in probe.runner.model.cache_specs if isinstance(s, StateSpec)]
    slots = 2 * StateCache.bytes_per_slot(len(states), states[0], torch.float32)
    per_block = probe.config.kv_bytes_per_block(1)
    # Room for the two state slots, 16 MiB of snapshots and 40 blocks: fewer than two full-length sequences' 64.
    monkeypatch.setattr(CpuPlatform, "kv_memory_budget", lambda self, device: slots + (16 << 20) + 40 * per_block)
    blocks = {on: make_engine(checkpoint, max_model_len=256, max_num_seqs=2, enable_prefix_caching=on,
                              backend_options={"block_size": 8, "state_snapshot_mb": 16}).runner.num_kv_blocks
              for on in (False, True)}
    assert blocks == {False: 64, True: 40}


def test_a_qwen3_5_gguf_is_served_by_torch_and_auto_picks_cpp_on_x86(tmp_path) -> None:
    from pocketllm import LLM

    hf, _ = tiny_qwen3_5(tmp_path / "hf", shared_expert_ff=64)
    path = str(to_gguf(hf, tmp_path / "model.gguf"))
    ids = prompt(20, offset=1)
    llm = LLM(path, backend="torch", dtype="float32")
    try:
        assert llm.generate([ids], greedy(8))[0].outputs[0].token_ids == hf_greedy(hf, ids, 8)
    finally:
        llm.shutdown()
    native = pytest.importorskip("pocketllm_cpp._native")
    llm = LLM(path, backend="auto")
    try:
        assert llm.backend_name == ("cpp" if native.best_isa() in ("avx2", "avx512", "amx") else "torch")
    finally:
        llm.shutdown()


def test_kit_configs_are_exactly_what_the_config_classes_write(qwen) -> None:
    """No key by hand: the MoE text config has no intermediate_size, as Qwen3_5MoeTextConfig writes it."""
    import json

    from tests.core.test_checkpoint_configs import MODEL_WRITTEN, PUBLISHED_FIELDS

    _, checkpoint, _ = qwen
    written = json.loads((checkpoint.path / "config.json").read_text())
    moe = checkpoint.config.architecture == "qwen3_5_moe_text"
    fields = PUBLISHED_FIELDS["Qwen3_5MoeTextConfig" if moe else "Qwen3_5TextConfig"]
    if "text_config" in written:  # the wrapper class writes the version once, at its top level
        written, fields = written["text_config"], fields - {"transformers_version"}
    assert set(written) - MODEL_WRITTEN == fields
    assert checkpoint.config.intermediate_size == (0 if moe else 128)
