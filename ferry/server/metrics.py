"""Prometheus metrics at /metrics, named like vLLM's with the `ferry:` prefix.

The engine's gauges and counters (running, waiting, KV cache usage, prompt and generation tokens,
preemptions, prefix cache) come from the stats that the engine process sends with every step (read
at scrape time, so they cost nothing between scrapes). Request outcomes and latencies are measured
here, where the outputs reach the server, by a `RequestClock` per engine request (see
metrics/latency.py for the definitions):

    ferry:time_to_first_token_seconds    server arrival -> first token, per engine request
    ferry:inter_token_latency_seconds    per completion, between successive deltas (streamed chunks)
    ferry:e2e_request_latency_seconds    server arrival -> finished, per finished engine request
    ferry:request_queue_time_seconds     engine arrival -> first scheduled (the engine's clock)

With speculative decoding, vLLM's spec_decode counters say how proposals fare (acceptance rate =
accepted / draft tokens; mean accepted length = 1 + accepted / drafts; by position, how deep the
proposals stay right).

An engine request is one prompt with its n completions: a completions call with a list of P
prompts counts P times. Every metric carries a `model_name` label, the served model's name (as
vLLM's do), so that dashboards built for vLLM select ferry's series too. Every metric lives in this
server's own registry, not prometheus_client's global one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ferry.engine.messages import EngineStats
from ferry.metrics.latency import Latencies

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets, with finer ones where a fast GPU puts small models: a decode step of a few ms, a
# queue time of none at all, a short request well under a second.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0,
                    20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _EngineCollector:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats], restarts: Callable[[], int],
                 speculative: Callable[[], bool] = lambda: False) -> None:
        self._model_name = model_name
        self._stats = stats
        self._restarts = restarts
        self._speculative = speculative  # the spec_decode counters exist where the engine speculates

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        speculative = self._speculative()
        families = [
            (CounterMetricFamily, "ferry:engine_restarts", "Engine processes started after one died.",
             self._restarts()),
            (GaugeMetricFamily, "ferry:num_requests_running", "Sequences in the running batch.", s.num_running),
            (GaugeMetricFamily, "ferry:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting),
            (GaugeMetricFamily, "ferry:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
             s.kv_cache_usage),
            (CounterMetricFamily, "ferry:prompt_tokens", "Prompt tokens admitted.", s.prompt_tokens_total),
            (CounterMetricFamily, "ferry:generation_tokens", "Tokens generated.", s.generation_tokens_total),
            (CounterMetricFamily, "ferry:num_preemptions", "Preemptions by recompute.", s.num_preemptions_total),
            (CounterMetricFamily, "ferry:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             s.prefix_cache_queries_total),
            (CounterMetricFamily, "ferry:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             s.prefix_cache_hits_total),
        ]
        if speculative:
            families += [
                (CounterMetricFamily, "ferry:spec_decode_num_drafts", "Verify rows: a request's proposals checked in "
                 "one step.", s.spec_decode_num_drafts_total),
                (CounterMetricFamily, "ferry:spec_decode_num_draft_tokens", "Proposed tokens checked.",
                 s.spec_decode_num_draft_tokens_total),
                (CounterMetricFamily, "ferry:spec_decode_num_accepted_tokens", "Proposed tokens kept.",
                 s.spec_decode_num_accepted_tokens_total),
            ]
        for family, name, documentation, value in families:
            metric = family(name, documentation, labels=["model_name"])
            metric.add_metric([self._model_name], value)
            yield metric
        if speculative:
            per_pos = CounterMetricFamily("ferry:spec_decode_num_accepted_tokens_per_pos",
                                          "Proposed tokens kept, by their position in the proposal (0: the first).",
                                          labels=["model_name", "position"])
            for position, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                per_pos.add_metric([self._model_name, str(position)], value)
            yield per_pos


class ServerMetrics:
    def __init__(
        self, model_name: str, engine_stats: Callable[[], EngineStats], engine_restarts: Callable[[], int] = lambda: 0,
        speculative: Callable[[], bool] = lambda: False,
    ) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model_name, engine_stats, engine_restarts, speculative))

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]):
            """The series of this server's model (the only one it has)."""
            return Histogram(name, documentation, ["model_name"], buckets=buckets, registry=self.registry) \
                .labels(model_name)

        self._model_name = model_name
        self._request_success = Counter(
            "ferry:request_success", "Completions finished, by finish reason.", ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self._requests_rejected = Counter(
            "ferry:requests_rejected", "HTTP requests refused before reaching the engine, by status.",
            ["model_name", "status"], registry=self.registry,
        )
        self.time_to_first_token = histogram(
            "ferry:time_to_first_token_seconds", "From the server's arrival of a request to its first token.",
            _TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "ferry:inter_token_latency_seconds", "Time between successive output deltas (chunks) of a completion.",
            _ITL_BUCKETS,
        )
        self.e2e_latency = histogram(
            "ferry:e2e_request_latency_seconds", "From the server's arrival of a request to its last token.",
            _REQUEST_BUCKETS,
        )
        self.queue_time = histogram(
            "ferry:request_queue_time_seconds", "From the engine's arrival of a request to its first schedule.",
            _REQUEST_BUCKETS,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, latencies: Latencies) -> None:
        if latencies.time_to_first_token is not None:
            self.time_to_first_token.observe(latencies.time_to_first_token)
        for gap in latencies.inter_token_latencies:
            self.inter_token_latency.observe(gap)
        if latencies.e2e_latency is not None:
            self.e2e_latency.observe(latencies.e2e_latency)
        if latencies.queue_time is not None:
            self.queue_time.observe(latencies.queue_time)

    def finished(self, finish_reasons: Iterable[str]) -> None:
        """One HTTP request is over: how each of its completions ended."""
        for reason in finish_reasons:
            self._request_success.labels(self._model_name, reason).inc()

    def rejected(self, status: int) -> None:
        """An HTTP request was refused before it reached the engine."""
        self._requests_rejected.labels(self._model_name, str(status)).inc()
