"""Block manager and scheduler: block accounting, continuous batching, chunked prefill and preemption."""

from __future__ import annotations

import pytest

from tests.torch.torch_testkit import add, greedy, make_engine, prompt, run_to_completion, tiny_model

pytest.importorskip("transformers")

from pocketllm.sampling_params import SamplingParams
from pocketllm_torch.block_manager import BlockManager
from pocketllm_torch.scheduler import Scheduler
from pocketllm_torch.sequence import Sequence, SequenceStatus


@pytest.fixture(scope="module")
def checkpoint():
    return tiny_model("llama", tie=True, seed=1)[1]


def make_seq(request_id: str, num_prompt: int) -> Sequence:
    return Sequence(request_id, prompt(num_prompt), num_prompt, greedy(8), 8, frozenset(), None)


def test_block_manager_allocates_and_frees() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)
    seq = make_seq("a", 9)
    assert manager.blocks_needed(seq, 9) == 3 and manager.can_allocate(seq, 9)
    manager.allocate(seq, 9)
    assert 0 not in seq.block_table and len(set(seq.block_table)) == 3 and manager.num_used_blocks == 3
    assert manager.blocks_needed(seq, 12) == 0 and manager.blocks_needed(seq, 13) == 1
    assert not manager.can_allocate(seq, 17)
    manager.free(seq)
    assert seq.block_table == [] and manager.num_used_blocks == 0 and set(manager.ref_counts) == {0}


def test_freed_blocks_are_reused_before_untouched_ones() -> None:
    manager = BlockManager(num_blocks=8, block_size=4)
    first = make_seq("a", 8)
    manager.allocate(first, 8)
    used = set(first.block_table)
    manager.free(first)
    for name in "bcd":  # one request after another touches no block beyond the first request's
        seq = make_seq(name, 8)
        manager.allocate(seq, 8)
        assert set(seq.block_table) == used
        manager.free(seq)


def test_prefix_cache_adopts_full_blocks_and_evicts_tails_first() -> None:
    manager = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    first = make_seq("a", 10)
    manager.admit(first, manager.cached_prefix(first), 10)
    first.num_computed_tokens = 10
    manager.cache_computed_blocks(first)  # two full blocks filed; the third is partial
    assert len(first.block_hashes) == 2 and list(manager.cached_block_ids.values()) == first.block_table[:2]
    manager.free(first)
    assert manager.num_used_blocks == 0

    second = make_seq("b", 9)  # same first 9 tokens: both full blocks hit, the 9th token is recomputed
    prefix = manager.cached_prefix(second)
    assert prefix == list(manager.cached_block_ids) and manager.can_admit(second, prefix, 9)
    manager.admit(second, prefix, 9)
    assert second.num_computed_tokens == 8 and second.block_table[:2] == [1, 2]
    assert (manager.num_queried_tokens, manager.num_hit_tokens) == (19, 8)
    assert len(manager.cached_prefix(make_seq("c", 8))) == 1  # a two-block prompt recomputes its last block
    manager.free(second)

    other = Sequence("d", list(range(100, 120)), 20, greedy(8), 8, frozenset(), None)
    manager.admit(other, [], 20)  # five of six blocks: evicts the never-cached ones, then the newest prefix block
    assert manager.cached_prefix(make_seq("e", 9)) == prefix[:1]


def test_prefill_chunks_share_the_token_budget_and_take_turns_with_decode() -> None:
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10, prefill_chunk_size=6)
    a, b, c = make_seq("a", 9), make_seq("b", 3), make_seq("c", 5)
    for seq in (a, b, c):
        scheduler.add(seq)
    batch = scheduler.schedule()  # nothing decodes: the prompts share the whole budget, a chunk at most each
    assert (batch.seqs, batch.num_new_tokens) == ([a, b, c], [6, 3, 1])
    scheduler.mark_computed(batch)
    b.token_ids.append(1)  # b sampled its first token; a and c are still in their prompts
    batch = scheduler.schedule()  # b decodes: a decode step comes between prefill steps
    assert (batch.seqs, batch.num_new_tokens) == ([b], [1])
    scheduler.mark_computed(batch)
    b.token_ids.append(1)
    batch = scheduler.schedule()  # and a prefill step holds one chunk (6 tokens) in all
    assert (batch.seqs, batch.num_new_tokens) == ([a, c], [3, 3])
    scheduler.mark_computed(batch)
    a.token_ids.append(1)
    batch = scheduler.schedule()  # c's last prompt token runs as decode rows do
    assert (batch.seqs, batch.num_new_tokens) == ([a, b, c], [1, 1, 1])


def test_a_prefill_beside_decodes_stays_within_the_step_budget() -> None:
    """A chunk larger than the step's budget: the prompt beside a decode gets the budget, not the chunk."""
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8, prefill_chunk_size=32)
    a = make_seq("a", 3)
    scheduler.add(a)
    scheduler.mark_computed(scheduler.schedule())
    a.token_ids.append(1)
    b = make_seq("b", 40)
    scheduler.add(b)
    scheduler.mark_computed(scheduler.schedule())  # the decode step (a prefill step came last)
    a.token_ids.append(1)  # a decodes on
    batch = scheduler.schedule()
    assert (batch.seqs, batch.num_new_tokens) == ([b], [8])


def test_preemption_frees_the_newest_and_requeues_it_first() -> None:
    manager = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64, prefill_chunk_size=64)
    a, b = make_seq("a", 8), make_seq("b", 8)
    scheduler.add(a)
    scheduler.add(b)
    batch = scheduler.schedule()
    scheduler.mark_computed(batch)
    a.token_ids.append(1)
    b.token_ids.append(1)
    batch = scheduler.schedule()  # both need a third block; only a gets one
    assert batch.seqs == [a] and scheduler.num_preemptions == 1
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert scheduler.waiting[0] is b and manager.num_used_blocks == 3


def test_batch_of_eight_equals_each_alone(checkpoint) -> None:
    requests = {str(i): (prompt(5 + 9 * i, offset=i), greedy(16)) for i in range(8)}
    batched = run_to_completion(make_engine(checkpoint), requests)
    engine = make_engine(checkpoint)
    alone = {rid: run_to_completion(engine, {rid: request})[rid] for rid, request in requests.items()}
    assert batched == alone


def test_request_added_mid_flight_joins_the_running_batch(checkpoint) -> None:
    engine = make_engine(checkpoint)
    add(engine, "first", prompt(10), greedy(20))
    first: list[int] = []
    for _ in range(5):
        first += engine.step()[0].new_token_ids
    add(engine, "second", prompt(12, offset=3), greedy(6))
    steps = []
    while engine.has_unfinished():
        steps.append({d.request_id: d.new_token_ids for d in engine.step()})
    assert steps[0].keys() == {"second"}  # its prefill step
    assert steps[1].keys() == {"first", "second"}  # then one decode batch
    first += [t for step in steps for t in step.get("first", [])]
    second = [t for step in steps for t in step.get("second", [])]
    alone = run_to_completion(make_engine(checkpoint), {"first": (prompt(10), greedy(20)),
                                                        "second": (prompt(12, offset=3), greedy(6))})
    assert {"first": first, "second": second} == alone


def test_preemption_by_recompute_gives_the_same_tokens(checkpoint) -> None:
    requests = {str(i): (prompt(20 + i, offset=i), greedy(40)) for i in range(4)}
    roomy = run_to_completion(make_engine(checkpoint), requests)
    engine = make_engine(checkpoint, max_model_len=64, backend_options={"block_size": 4, "num_kv_blocks": 24})
    assert run_to_completion(engine, requests) == roomy
    assert engine.stats().num_preemptions > 0
    assert engine.stats().num_kv_blocks_used == 0


def test_prefix_caching_reuses_blocks_and_keeps_outputs(checkpoint) -> None:
    shared = prompt(50)
    requests = {str(i): (shared + prompt(3 + i, offset=i), greedy(12)) for i in range(4)}
    plain = {rid: run_to_completion(make_engine(checkpoint), {rid: r})[rid] for rid, r in requests.items()}
    engine = make_engine(checkpoint, enable_prefix_caching=True, backend_options={"block_size": 8})
    cached = {rid: run_to_completion(engine, {rid: r})[rid] for rid, r in requests.items()}
    assert cached == plain
    stats = engine.stats()
    assert stats.num_prefix_cache_hits == 3 * 48 and stats.num_kv_blocks_used == 0
    # Batched, preempted and cached at once: recomputation after preemption hits the cache too.
    engine = make_engine(checkpoint, enable_prefix_caching=True, max_model_len=96,
                         backend_options={"block_size": 8, "num_kv_blocks": 16})
    assert run_to_completion(engine, requests) == plain
    assert engine.stats().num_preemptions > 0 and engine.stats().num_prefix_cache_hits > 0


def test_blocks_are_freed_on_finish_and_abort(checkpoint) -> None:
    engine = make_engine(checkpoint, prefill_chunk_size=8, max_num_seqs=2)
    add(engine, "long", prompt(60), greedy(50))  # takes several prefill steps
    add(engine, "short", prompt(5, offset=1), greedy(3))
    add(engine, "queued", prompt(5, offset=2), greedy(3))  # max_num_seqs keeps it waiting
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (2, 1, 2)
    engine.abort(["long", "queued", "unknown"])  # mid-prefill, waiting, and a no-op
    assert engine.stats().num_kv_blocks_used == 1  # short's
    while engine.has_unfinished():
        engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)


def test_abort_while_decoding_frees_blocks(checkpoint) -> None:
    engine = make_engine(checkpoint)
    add(engine, "a", prompt(30), SamplingParams(max_tokens=100, seed=3))
    for _ in range(4):
        engine.step()
    assert engine.stats().num_kv_blocks_used > 0
    engine.abort(["a"])
    assert not engine.has_unfinished() and engine.stats().num_kv_blocks_used == 0
