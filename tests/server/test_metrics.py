"""/metrics is valid Prometheus text with vLLM's metric names, and its counters follow the traffic."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pocketllm import AsyncLLM, BackendStats


def scrape(client: httpx.Client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted({"model_name": "tiny", **labels}.items()))), 0.0)


def test_every_metric_is_there_and_labelled(client: httpx.Client) -> None:
    samples = scrape(client)
    names = {name for name, _ in samples}
    for name in ("pocketllm:num_requests_running", "pocketllm:num_requests_waiting", "pocketllm:kv_cache_usage_perc",
                 "pocketllm:num_preemptions_total", "pocketllm:prefix_cache_queries_total",
                 "pocketllm:prefix_cache_hits_total", "pocketllm:prompt_tokens_total",
                 "pocketllm:generation_tokens_total", "pocketllm:client_disconnect_cancellations_total",
                 "pocketllm:time_to_first_token_seconds_count", "pocketllm:inter_token_latency_seconds_count",
                 "pocketllm:e2e_request_latency_seconds_count", "pocketllm:request_queue_time_seconds_count"):
        assert name in names, name
    assert all(dict(labels).get("model_name") == "tiny" for name, labels in samples if name.startswith("pocketllm:"))


def test_counters_follow_requests(client: httpx.Client, echo_llm: AsyncLLM) -> None:
    before = scrape(client)
    prompt_ids = echo_llm.tokenizer.encode("metrics please")
    body = {"prompt": "metrics please", "temperature": 0, "max_tokens": 5, "n": 2}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert client.post("/v1/completions", json={**body, "stream": True}).status_code == 200
    after = scrape(client)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("pocketllm:prompt_tokens_total") == 2 * len(prompt_ids)
    assert delta("pocketllm:generation_tokens_total") == 2 * 2 * 5
    assert delta("pocketllm:request_success_total", finished_reason="length") == 4
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert delta(f"pocketllm:{histogram}_count") == 2
    assert delta("pocketllm:inter_token_latency_seconds_count") == 2 * 2 * 4  # 5 outputs per choice: 4 gaps


def test_engine_gauges_and_counters_are_read_at_scrape_time(client: httpx.Client, echo_llm: AsyncLLM,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    stats = BackendStats(num_running=3, num_waiting=2, num_kv_blocks_total=10, num_kv_blocks_used=4,
                         num_preemptions=7, num_prefix_cache_queries=100, num_prefix_cache_hits=40)
    monkeypatch.setattr(echo_llm, "stats", lambda: stats)
    samples = scrape(client)
    assert value(samples, "pocketllm:num_requests_running") == 3
    assert value(samples, "pocketllm:num_requests_waiting") == 2
    assert value(samples, "pocketllm:kv_cache_usage_perc") == pytest.approx(0.4)
    assert value(samples, "pocketllm:kv_cache_blocks_used") == 4
    assert value(samples, "pocketllm:kv_cache_blocks_total") == 10
    assert value(samples, "pocketllm:num_preemptions_total") == 7
    assert value(samples, "pocketllm:prefix_cache_queries_total") == 100
    assert value(samples, "pocketllm:prefix_cache_hits_total") == 40


def test_speculative_decoding_counters_follow_the_engine_s(client: httpx.Client, echo_llm: AsyncLLM,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    stats = BackendStats(num_spec_drafts=5, num_spec_draft_tokens=15, num_spec_accepted_tokens=9,
                         spec_accepted_per_position=[5, 3, 1])
    monkeypatch.setattr(echo_llm, "stats", lambda: stats)
    samples = scrape(client)
    assert value(samples, "pocketllm:spec_decode_num_drafts_total") == 5
    assert value(samples, "pocketllm:spec_decode_num_draft_tokens_total") == 15
    assert value(samples, "pocketllm:spec_decode_num_accepted_tokens_total") == 9
    assert [value(samples, "pocketllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
            for i in range(3)] == [5, 3, 1]


def test_state_snapshot_counters_follow_a_hybrid_model_s_prefix_hits(tmp_path, serve_app) -> None:
    """A Qwen3.5 on the torch backend: a request repeating a prompt's prefix resumes from a Gated DeltaNet state
    snapshot, which /metrics counts beside the prefix-cache hits."""
    pytest.importorskip("pocketllm_torch")
    from pocketllm import EngineArgs
    from pocketllm.testing.checkpoints import write_checkpoint
    from pocketllm_server import create_app

    args = EngineArgs(model=str(write_checkpoint("qwen3_5", tmp_path)), backend="torch", device="cpu",
                      dtype="float32", enable_prefix_caching=True, backend_options={"block_size": 8})
    llm = AsyncLLM(engine_args=args)
    try:
        with serve_app(create_app(args, served_model_name="tiny", llm=llm)) as server, \
                httpx.Client(base_url=server.url, timeout=60) as client:
            before = scrape(client)
            shared = "a long shared system prompt, " * 6
            for question in ("first?", "second?"):
                body = {"prompt": shared + question, "temperature": 0, "max_tokens": 2}
                assert client.post("/v1/completions", json=body).status_code == 200
            after = scrape(client)
    finally:
        llm.shutdown()

    def delta(name: str) -> float:
        return value(after, name) - value(before, name)

    assert delta("pocketllm:state_snapshot_hits_total") == 1
    assert value(after, "pocketllm:state_snapshots") > 0
    assert delta("pocketllm:prefix_cache_hits_total") >= 8
    assert delta("pocketllm:state_snapshot_evictions_total") == 0


def test_the_grammar_cache_is_counted_in_bytes_and_entries(torch_server) -> None:
    """Issue 31, item 2: the compiled grammars kept for reuse, and their estimated memory, within its capacity."""
    with httpx.Client(base_url=torch_server.url, timeout=60) as client:
        before = scrape(client)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
        for i in range(3):
            assert client.post("/v1/chat/completions", json=body | {"guided_regex": f"metrics{i}[a-z]+"}).status_code \
                == 200
        assert client.post("/v1/chat/completions", json=body | {"guided_regex": "[^\\s\\S]"}).status_code == 400
        after = scrape(client)
    assert value(after, "pocketllm:grammar_cache_entries") == value(before, "pocketllm:grammar_cache_entries") + 3
    grown = value(after, "pocketllm:grammar_cache_bytes") - value(before, "pocketllm:grammar_cache_bytes")
    assert 3 * (32 << 10) < grown < 3 * (1 << 20)
    assert value(after, "pocketllm:grammar_cache_capacity_bytes") == 64 << 20


@pytest.mark.parametrize(("kind", "method"), [("llama-cyclic", "ngram"), ("qwen3_5-cyclic-mtp", "mtp")])
def test_a_server_with_drafts_counts_them_and_answers_as_without(tmp_path, serve_app, kind: str,
                                                                  method: str) -> None:
    """`--speculative-method ngram` (or `mtp`, the checkpoint's head) on the cpp backend, through the OpenAI
    client: the same completion as a server without drafts, and /metrics counting the drafts and the accepted
    tokens per position."""
    pytest.importorskip("pocketllm_cpp._native")
    import openai

    from pocketllm import EngineArgs
    from pocketllm.testing.checkpoints import write_checkpoint
    from pocketllm_server import create_app

    model = str(write_checkpoint(kind, tmp_path))
    answers, samples = [], []
    for spec in ({}, {"speculative_method": method, "num_speculative_tokens": 4}):
        args = EngineArgs(model=model, backend="cpp", **spec)
        llm = AsyncLLM(engine_args=args)
        try:
            with serve_app(create_app(args, served_model_name="tiny", llm=llm)) as server, \
                    httpx.Client(base_url=server.url, timeout=60) as http:
                client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
                completion = client.completions.create(model="tiny", prompt="the cat sat on", max_tokens=32,
                                                       temperature=0, extra_body={"ignore_eos": True})
                answers.append(completion.choices[0].text)
                samples.append(scrape(http))
        finally:
            llm.shutdown()
    assert answers[0] == answers[1]
    plain, drafting = samples
    assert value(plain, "pocketllm:spec_decode_num_drafts_total") == 0
    accepted = value(drafting, "pocketllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= value(drafting, "pocketllm:spec_decode_num_draft_tokens_total")
    assert value(drafting, "pocketllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0
