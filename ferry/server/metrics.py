"""Prometheus metrics at /metrics, named like vLLM's with the `ferry:` prefix.

The engine's gauges and token counters come from the stats that the engine process sends with every
step (read at scrape time, so they cost nothing between scrapes); request outcomes and latencies
are counted here, where the requests end. Every metric lives in this server's own registry, not
prometheus_client's global one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ferry.engine.messages import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield GaugeMetricFamily("ferry:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield GaugeMetricFamily("ferry:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield GaugeMetricFamily("ferry:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                                s.kv_cache_usage)
        yield CounterMetricFamily("ferry:prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens_total)
        yield CounterMetricFamily("ferry:generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield CounterMetricFamily("ferry:num_preemptions", "Preemptions by recompute.", s.num_preemptions_total)
        yield CounterMetricFamily("ferry:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  s.prefix_cache_queries_total)
        yield CounterMetricFamily("ferry:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                  s.prefix_cache_hits_total)


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine_stats))
        self.request_success = Counter(
            "ferry:request_success", "Completions finished, by finish reason.", ["finished_reason"],
            registry=self.registry,
        )
        self.requests_rejected = Counter(
            "ferry:requests_rejected", "HTTP requests refused before reaching the engine, by status.", ["status"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "ferry:time_to_first_token_seconds", "From arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "ferry:e2e_request_latency_seconds", "From arrival to the last token.",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def first_token(self, arrival: float) -> None:
        self.time_to_first_token.observe(time.monotonic() - arrival)

    def finished(self, arrival: float, finish_reasons: Iterable[str]) -> None:
        """One HTTP request is over: its latency, and how each of its completions ended."""
        self.e2e_latency.observe(time.monotonic() - arrival)
        for reason in finish_reasons:
            self.request_success.labels(reason).inc()
