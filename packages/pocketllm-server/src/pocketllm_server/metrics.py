"""Prometheus metrics with vLLM's names under a ``pocketllm:`` prefix, one registry per app."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pocketllm import BackendStats
from pocketllm.structured import GrammarCacheStats

_LABELS = ["model_name"]
# vLLM's buckets, so dashboards built for vLLM read these unchanged.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector(Collector):
    """Reads the backend's gauges and cumulative counters at scrape time, so they are never stale."""

    def __init__(self, model_name: str, stats: Callable[[], BackendStats | None]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        if stats is None:  # the model is still loading
            return
        values: list[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str, float]] = [
            (GaugeMetricFamily, "pocketllm:num_requests_running", "Number of requests running in the engine.",
             stats.num_running),
            (GaugeMetricFamily, "pocketllm:num_requests_waiting",
             "Number of requests waiting for an engine slot.", stats.num_waiting),
            (GaugeMetricFamily, "pocketllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             stats.kv_usage),
            (GaugeMetricFamily, "pocketllm:kv_cache_blocks_used", "KV-cache blocks in use.",
             stats.num_kv_blocks_used),
            (GaugeMetricFamily, "pocketllm:kv_cache_blocks_total", "KV-cache blocks in the pool.",
             stats.num_kv_blocks_total),
            (CounterMetricFamily, "pocketllm:num_preemptions", "Cumulative number of preemptions by the engine.",
             stats.num_preemptions),
            (CounterMetricFamily, "pocketllm:prefix_cache_queries",
             "Prefix-cache queries, in tokens.", stats.num_prefix_cache_queries),
            (CounterMetricFamily, "pocketllm:prefix_cache_hits", "Prefix-cache hits, in tokens.",
             stats.num_prefix_cache_hits),
            (GaugeMetricFamily, "pocketllm:state_snapshots", "Prefix-cache snapshots of state layers held.",
             stats.num_state_snapshots),
            (CounterMetricFamily, "pocketllm:state_snapshot_hits",
             "Requests resumed from a prefix-cache snapshot of state layers.", stats.num_state_snapshot_hits),
            (CounterMetricFamily, "pocketllm:state_snapshot_evictions",
             "Prefix-cache snapshots of state layers evicted.", stats.num_state_snapshot_evictions),
            (CounterMetricFamily, "pocketllm:spec_decode_num_drafts",
             "Speculative drafts proposed (one per sequence and step that drafted).", stats.num_spec_drafts),
            (CounterMetricFamily, "pocketllm:spec_decode_num_draft_tokens", "Speculative tokens drafted.",
             stats.num_spec_draft_tokens),
            (CounterMetricFamily, "pocketllm:spec_decode_num_accepted_tokens", "Speculative draft tokens accepted.",
             stats.num_spec_accepted_tokens),
        ]
        for family, name, doc, value in values:
            metric = family(name, doc, labels=_LABELS)
            metric.add_metric([self.model_name], value)
            yield metric
        per_position = CounterMetricFamily("pocketllm:spec_decode_num_accepted_tokens_per_pos",
                                           "Speculative draft tokens accepted, by position in the draft.",
                                           labels=[*_LABELS, "position"])
        for position, accepted in enumerate(stats.spec_accepted_per_position):
            per_position.add_metric([self.model_name, str(position)], accepted)
        yield per_position


class _GrammarCacheCollector(Collector):
    """The core's cache of compiled grammars, read at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], GrammarCacheStats | None]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats()
        if stats is None:
            return
        for name, doc, value in (
                ("pocketllm:grammar_cache_entries", "Compiled structured-output grammars kept for reuse.",
                 stats.num_entries),
                ("pocketllm:grammar_cache_bytes", "Estimated memory of the compiled grammars kept.", stats.num_bytes),
                ("pocketllm:grammar_cache_capacity_bytes", "Memory the grammar cache may hold (--grammar-cache-mb).",
                 stats.capacity_bytes)):
            metric = GaugeMetricFamily(name, doc, labels=_LABELS)
            metric.add_metric([self.model_name], value)
            yield metric


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], BackendStats | None],
                 grammar_cache: Callable[[], GrammarCacheStats | None] = lambda: None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, stats))
        self.registry.register(_GrammarCacheCollector(model_name, grammar_cache))
        model = {"model_name": model_name}

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, _LABELS, buckets=buckets, registry=self.registry)

        self.prompt_tokens = counter("pocketllm:prompt_tokens", "Number of prefill tokens processed.").labels(**model)
        self.generation_tokens = counter("pocketllm:generation_tokens",
                                         "Number of generation tokens processed.").labels(**model)
        self._request_success = Counter("pocketllm:request_success", "Count of successfully finished choices.",
                                        [*_LABELS, "finished_reason"], registry=self.registry)
        self.client_disconnects = counter("pocketllm:client_disconnect_cancellations",
                                          "Requests cancelled because the client disconnected.").labels(**model)
        self.time_to_first_token = histogram("pocketllm:time_to_first_token_seconds",
                                             "Time from arrival to the first generated token.",
                                             _TTFT_BUCKETS).labels(**model)
        self.inter_token_latency = histogram("pocketllm:inter_token_latency_seconds",
                                             "Time between successive streamed outputs of one choice.",
                                             _ITL_BUCKETS).labels(**model)
        self.e2e_request_latency = histogram("pocketllm:e2e_request_latency_seconds",
                                             "Time from arrival to the end of the request.",
                                             _REQUEST_BUCKETS).labels(**model)
        # The engine reports no per-request scheduling time; arrival to first output is the closest we see.
        self.request_queue_time = histogram("pocketllm:request_queue_time_seconds",
                                            "Time from arrival until the engine produced the first output.",
                                            _REQUEST_BUCKETS).labels(**model)
        self._model = model_name

    def request_success(self, finished_reason: str) -> None:
        self._request_success.labels(model_name=self._model, finished_reason=finished_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
