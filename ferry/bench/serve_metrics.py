"""The figures of a serving benchmark, with vLLM's definitions (benchmarks/serve.py).

Over the successful requests of a run that lasted D seconds (first arrival's wait to last reply):

    request throughput      successful requests / D
    output token throughput output tokens / D
    total token throughput  (input + output tokens) / D
    TTFT                    sent -> first token chunk, per request
    TPOT                    (latency - TTFT) / (output tokens - 1), per request of more than one token:
                            the mean time per token after the first
    ITL                     every gap between consecutive token chunks, of every request, pooled
    E2EL                    sent -> last token chunk, per request
    goodput                 requests that meet every given SLO / D; a request of one token has
                            TPOT 0 here, as in vLLM

Each latency is summarised by its mean, median, standard deviation (of the population, numpy's
default) and percentiles (numpy's linear interpolation), in milliseconds. Output tokens are the
server's usage.completion_tokens; without usage, the client's tokenizer counts the streamed text,
and without a tokenizer, each token chunk counts as one token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ferry.bench.openai_stream import RequestOutcome

SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Distribution:
    """One latency's summary, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: tuple[tuple[float, float], ...]  # (p, value) pairs

    @classmethod
    def of(cls, seconds: Sequence[float], percentiles: Sequence[float]) -> Distribution | None:
        if len(seconds) == 0:
            return None
        ms = np.asarray(seconds, dtype=float) * 1000
        return cls(
            mean=float(ms.mean()), median=float(np.median(ms)), std=float(ms.std()),
            percentiles=tuple((float(p), float(np.percentile(ms, p))) for p in percentiles),
        )


@dataclass(frozen=True)
class Slo:
    """Service level objectives for goodput, in milliseconds; None: no bound."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @classmethod
    def parse(cls, pairs: Sequence[str]) -> Slo | None:
        """`["ttft:200", "tpot:50"]`, as `--goodput` takes them; None when there are none."""
        if not pairs:
            return None
        bounds: dict[str, float] = {}
        for pair in pairs:
            name, sep, value = pair.partition(":")
            if not sep or name not in SLO_NAMES:
                raise ValueError(f"SLOs are NAME:MILLISECONDS, NAME one of {', '.join(SLO_NAMES)}; not {pair!r}")
            bounds[f"{name}_ms"] = float(value)
            if bounds[f"{name}_ms"] < 0:
                raise ValueError(f"an SLO must not be negative: {pair!r}")
        return cls(**bounds)

    def met(self, ttft: float, tpot: float, e2el: float) -> bool:
        """Whether a request with these latencies (in seconds) is good."""
        return all(
            bound is None or value * 1000 <= bound
            for bound, value in ((self.ttft_ms, ttft), (self.tpot_ms, tpot), (self.e2el_ms, e2el))
        )


@dataclass(frozen=True)
class ServeMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None  # None without SLOs
    output_throughput: float
    total_token_throughput: float
    max_concurrent_requests: int  # most requests in flight at once, of the successful ones
    ttft: Distribution | None  # None when no request succeeded
    tpot: Distribution | None
    itl: Distribution | None
    e2el: Distribution | None


def output_lengths(outcomes: Sequence[RequestOutcome], count_tokens: Callable[[str], int] | None) -> list[int]:
    """Tokens each request generated; 0 for a failed one."""
    lengths = []
    for o in outcomes:
        if not o.success:
            lengths.append(0)
        elif o.output_tokens is not None:
            lengths.append(o.output_tokens)
        elif count_tokens is not None:
            lengths.append(count_tokens(o.generated_text))
        else:
            lengths.append(o.num_token_chunks)
    return lengths


def tpot(outcome: RequestOutcome, output_len: int) -> float | None:
    """Seconds per output token after the first; None for a failed request or a single token."""
    if not outcome.success or output_len < 2:
        return None
    return (outcome.latency - outcome.ttft) / (output_len - 1)


def peak_concurrency(outcomes: Sequence[RequestOutcome]) -> int:
    # Intervals are half-open [start, end): at a tie, the request that ends leaves first.
    events = sorted(
        [(o.start_time, 1) for o in outcomes] + [(o.start_time + o.latency, -1) for o in outcomes]
    )
    peak = current = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def compute_metrics(
    outcomes: Sequence[RequestOutcome], duration_s: float, percentiles: Sequence[float], slo: Slo | None,
    count_tokens: Callable[[str], int] | None,
) -> ServeMetrics:
    lengths = output_lengths(outcomes, count_tokens)
    ok = [(o, n) for o, n in zip(outcomes, lengths) if o.success]
    tpots = [tpot(o, n) for o, n in ok]
    total_input = sum(o.prompt_len for o, _ in ok)
    total_output = sum(lengths)
    goodput = None
    if slo is not None:
        good = sum(slo.met(o.ttft, t or 0.0, o.latency) for (o, _), t in zip(ok, tpots))
        goodput = good / duration_s
    return ServeMetrics(
        completed=len(ok), failed=len(outcomes) - len(ok), duration_s=duration_s,
        total_input_tokens=total_input, total_output_tokens=total_output,
        request_throughput=len(ok) / duration_s, request_goodput=goodput,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        max_concurrent_requests=peak_concurrency([o for o, _ in ok]),
        ttft=Distribution.of([o.ttft for o, _ in ok], percentiles),
        tpot=Distribution.of([t for t in tpots if t is not None], percentiles),
        itl=Distribution.of([gap for o, _ in ok for gap in o.itl], percentiles),
        e2el=Distribution.of([o.latency for o, _ in ok], percentiles),
    )


LATENCIES = (  # (attribute and JSON key, short name, heading)
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p).is_integer() else f"p{p:g}"


def metric_fields(m: ServeMetrics) -> dict:
    """The summary under vLLM's JSON keys: mean_ttft_ms, p99_itl_ms, ... (None where there is no sample)."""
    fields = {
        "duration": m.duration_s, "completed": m.completed, "failed": m.failed,
        "total_input_tokens": m.total_input_tokens, "total_output_tokens": m.total_output_tokens,
        "request_throughput": m.request_throughput, "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput, "total_token_throughput": m.total_token_throughput,
        "max_concurrent_requests": m.max_concurrent_requests,
    }
    for key, _, _ in LATENCIES:
        d: Distribution | None = getattr(m, key)
        fields[f"mean_{key}_ms"] = None if d is None else d.mean
        fields[f"median_{key}_ms"] = None if d is None else d.median
        fields[f"std_{key}_ms"] = None if d is None else d.std
        for p, value in () if d is None else d.percentiles:
            fields[f"{percentile_key(p)}_{key}_ms"] = value
    return fields


def format_report(m: ServeMetrics, title: str = "Serving Benchmark Result") -> str:
    """vLLM's plain-text table."""
    rows = [f"{' ' + title + ' ':=^50}"]
    row = lambda label, value: rows.append(f"{label:<40} {value}")  # noqa: E731
    row("Successful requests:", m.completed)
    row("Failed requests:", m.failed)
    row("Benchmark duration (s):", f"{m.duration_s:.2f}")
    row("Total input tokens:", m.total_input_tokens)
    row("Total generated tokens:", m.total_output_tokens)
    row("Request throughput (req/s):", f"{m.request_throughput:.2f}")
    if m.request_goodput is not None:
        row("Request goodput (req/s):", f"{m.request_goodput:.2f}")
    row("Output token throughput (tok/s):", f"{m.output_throughput:.2f}")
    row("Total token throughput (tok/s):", f"{m.total_token_throughput:.2f}")
    row("Peak concurrent requests:", m.max_concurrent_requests)
    for key, short, heading in LATENCIES:
        d: Distribution | None = getattr(m, key)
        if d is None:
            continue
        rows.append(f"{heading:-^50}")
        row(f"Mean {short} (ms):", f"{d.mean:.2f}")
        row(f"Median {short} (ms):", f"{d.median:.2f}")
        row(f"Std {short} (ms):", f"{d.std:.2f}")
        for p, value in d.percentiles:
            row(f"{percentile_key(p).upper()} {short} (ms):", f"{value:.2f}")
    rows.append("=" * 50)
    return "\n".join(rows)
