"""`ferry bench soak`: overload a running ferry server for a long time and check that it stays whole.

    ferry serve --port 8000 &
    ferry bench soak --server-pid $! --duration 1800 --result-file soak.json

    capacity   a closed loop of --capacity-concurrency requests for --capacity-duration s: the
               completed requests per second of the workload (or --capacity REQ_PER_S)
    overload   Poisson arrivals at --overload x capacity for --duration s, --stream-fraction of them
               streamed; --cancel-fraction are given up by the client after a random delay (the
               connection is closed before the reply or mid-stream)
    settle     the requests in flight end (each within --timeout); then GET /metrics until the
               engine's gauges are back to 0
    alongside  the RSS of --server-pid and of its descendants (the engine process), every few seconds

Every request sent ends in exactly one outcome:

    ok                200 and complete: a stream's `data: [DONE]`, a reply whose choices all finished
    rejected_429      the queue is full; its Retry-After is kept
    rejected_503      draining, or the engine restarting
    error_<status>    any other status
    stream_error      an error event inside a 200 stream
    incomplete        200 but not a whole reply: a stream without [DONE], a body that is no completion
    cancelled         closed by the client
    timeout           --timeout passed
    connection_error  the connection broke, or could not be made

The soak passes when the outcomes add up to the requests sent (one each), no status but 503 is a
5xx, no stream failed (stream_error, incomplete), every 429 carries an integer Retry-After >= 1, the
gauges are 0 after, and (with --server-pid) the RSS after warm-up grows by less than --max-rss-slope.

Retry-After truth: the server derives a 429's Retry-After R from its queue's expected drain time.
The wait that requests really had at that moment shows in the requests admitted then: the mean
end-to-end latency (sent to last byte) of the `ok` requests sent within 1 s of the 429, their time
in the queue plus their service, which is the drain time by Little's law. The report gives the
distribution of R / that wait, over the 429s that have such neighbours.

The client is bounded: requests go to a loopback base URL only (the RSS is read from /proc on the
same machine anyway), arrivals stop after --duration s or --max-requests, and at most
--max-outstanding requests are in flight (an arrival past that is dropped before it is sent, and
counted apart), and each request ends within --timeout, so the run ends by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import ipaddress
import itertools
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from ferry.bench.arrivals import ArrivalProcess
from ferry.bench.datasets import Lengths, PromptMaker, WorkloadConfig, load_tokenizer, make_workload
from ferry.bench.openai_stream import Api, RequestInput, StreamError, Target
from ferry.bench.serve import ServerUnreachable, first_model
from ferry.bench.serve_metrics import Distribution
from ferry.bench.sse import SseParser

OK = "ok"
REJECTED_429 = "rejected_429"
REJECTED_503 = "rejected_503"
STREAM_ERROR = "stream_error"
INCOMPLETE = "incomplete"
CANCELLED = "cancelled"
TIMEOUT = "timeout"
CONNECTION_ERROR = "connection_error"
OUTCOMES = (OK, REJECTED_429, REJECTED_503, CANCELLED, STREAM_ERROR, INCOMPLETE, TIMEOUT, CONNECTION_ERROR)
GAUGES = ("ferry:num_requests_running", "ferry:num_requests_waiting", "ferry:kv_cache_usage_perc")
NEIGHBOUR_WINDOW_S = 1.0  # ok requests sent this close to a 429 measure the wait of its moment
CAPACITY_BACKOFF_S = 0.5  # a closed-loop worker whose request failed waits this long before the next
MIB = 1 << 20


# ---- outcomes and their accounting ----


@dataclass(frozen=True)
class Record:
    """One request's terminal outcome."""

    outcome: str  # one of OUTCOMES, or error_<status>
    sent_at: float  # seconds after its phase began
    latency: float  # seconds from sent to the outcome (for ok: to the reply's last byte)
    streamed: bool
    retry_after: str | None = None  # the header of a refusal, as sent


@dataclass(frozen=True)
class Accounting:
    sent: int
    outcomes: int  # outcomes recorded, a request recorded twice counting twice
    without_outcome: int
    recorded_twice: int

    @property
    def exactly_one(self) -> bool:
        return self.sent == self.outcomes and self.without_outcome == 0 and self.recorded_twice == 0


class Ledger:
    """Every request sent gets exactly one outcome: `open()`, just before it is sent, hands out its
    id, `close(id, record)` gives it its outcome. A request left open or closed twice is a fault of
    the client's accounting, which `accounting()` shows rather than hides."""

    def __init__(self) -> None:
        self.records: list[Record | None] = []  # by id; None while the request is in flight
        self.in_flight = 0
        self._closes = 0
        self._closed_twice = 0

    @property
    def sent(self) -> int:
        return len(self.records)

    def open(self) -> int:
        self.records.append(None)
        self.in_flight += 1
        return len(self.records) - 1

    def close(self, request_id: int, record: Record) -> None:
        self._closes += 1
        if self.records[request_id] is not None:
            self._closed_twice += 1
            return
        self.records[request_id] = record
        self.in_flight -= 1

    def done(self) -> list[Record]:
        return [r for r in self.records if r is not None]

    def counts(self) -> dict[str, int]:
        return outcome_counts(self.done())

    def accounting(self) -> Accounting:
        return Accounting(self.sent, self._closes, self.records.count(None), self._closed_twice)


def outcome_counts(records: Iterable[Record]) -> dict[str, int]:
    """Outcomes in OUTCOMES' order, then the error_<status> ones by status; zeros left out."""
    counts = Counter(r.outcome for r in records)
    order = [o for o in OUTCOMES if counts[o]] + sorted(o for o in counts if o not in OUTCOMES)
    return {o: counts[o] for o in order}


def refusal(status: int) -> str:
    return {429: REJECTED_429, 503: REJECTED_503}.get(status, f"error_{status}")


def is_bad_5xx(outcome: str) -> bool:
    """A 5xx other than 503, which a server may send on purpose (draining, engine restarting)."""
    return outcome.startswith("error_5")


def retry_after_seconds(value: str | None) -> int | None:
    """Retry-After as delta-seconds (ferry never sends the HTTP-date form); None when it is not one."""
    return int(value) if value is not None and value.strip().isdigit() else None


# ---- one request ----


@dataclass(frozen=True)
class Planned:
    request: RequestInput
    streamed: bool
    cancel_after_s: float | None = None  # the client gives up this long after sending; None: never


def request_body(target: Target, planned: Planned) -> dict:
    body = target.payload(planned.request)  # a streamed request that asks for usage
    if not planned.streamed:
        body = {k: v for k, v in body.items() if k != "stream_options"} | {"stream": False}
    return body


async def send(session: aiohttp.ClientSession, target: Target, planned: Planned, origin: float) -> Record:
    """Send one request and give it its outcome; raises only when the caller is cancelled."""
    sent = time.perf_counter()
    retry_after = None
    try:
        # The client's own cancellation is a timeout too: leaving the block closes the connection,
        # before the reply or mid-stream (aiohttp does not reuse a connection whose body is unread).
        async with asyncio.timeout(planned.cancel_after_s) as cancel, asyncio.timeout(target.timeout_s) as limit:
            outcome, retry_after = await _exchange(session, target, planned)
    except TimeoutError:  # before OSError, of which it is one
        outcome = CANCELLED if cancel.expired() and not limit.expired() else TIMEOUT
    except StreamError:
        outcome = STREAM_ERROR
    except ValueError:  # a body that is not JSON, or not UTF-8
        outcome = INCOMPLETE
    except (aiohttp.ClientError, OSError):
        outcome = CONNECTION_ERROR
    return Record(outcome, sent - origin, time.perf_counter() - sent, planned.streamed, retry_after)


async def _exchange(session: aiohttp.ClientSession, target: Target, planned: Planned) -> tuple[str, str | None]:
    async with session.post(target.url, json=request_body(target, planned), headers=target.headers) as response:
        if response.status != 200:
            await response.read()
            return refusal(response.status), response.headers.get("Retry-After")
        if planned.streamed:
            return await _read_stream(response), None
        return reply_outcome(await response.read()), None


async def _read_stream(response: aiohttp.ClientResponse) -> str:
    parser, done = SseParser(), False
    async for piece in response.content.iter_any():
        for data in parser.feed(piece):
            done = stream_event(data) or done
    for data in parser.finish():
        done = stream_event(data) or done
    return OK if done else INCOMPLETE


def stream_event(data: str) -> bool:
    """True for the stream's end; raises StreamError for an error event, ValueError for bad JSON."""
    if data.strip() == "[DONE]":
        return True
    event = json.loads(data)
    if isinstance(event, dict) and "error" in event:
        raise StreamError(json.dumps(event["error"])[:300])
    return False


def reply_outcome(body: bytes) -> str:
    reply = json.loads(body)
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if choices and all(isinstance(c, dict) and c.get("finish_reason") for c in choices):
        return OK
    return INCOMPLETE


async def tracked(
    session: aiohttp.ClientSession, target: Target, planned: Planned, ledger: Ledger, origin: float,
) -> Record | None:
    """`send` under the ledger. An exception `send` did not expect is a fault of the client: the run
    goes on, and the request stays without an outcome, which fails the accounting check."""
    request_id = ledger.open()
    try:
        record = await send(session, target, planned, origin)
    except Exception as e:
        print(f"ferry bench soak: request {request_id} has no outcome: {type(e).__name__}: {e}", file=sys.stderr)
        return None
    ledger.close(request_id, record)
    return record


# ---- the capacity phase ----


@dataclass(frozen=True)
class Capacity:
    per_second: float
    measured: bool  # False: given with --capacity
    duration_s: float = 0.0
    concurrency: int = 0


def completion_rate(records: Iterable[Record], duration_s: float) -> float:
    """ok requests per second over the last three quarters of a closed loop of duration_s: in the
    first quarter the loop ramps up (all its requests start at once and none has finished yet)."""
    start = duration_s / 4
    ended = sum(r.outcome == OK and start <= r.sent_at + r.latency <= duration_s for r in records)
    return ended / (duration_s - start)


async def measure_capacity(
    session: aiohttp.ClientSession, target: Target, prompts: Sequence[RequestInput], concurrency: int,
    duration_s: float,
) -> tuple[Capacity, Ledger]:
    """A closed loop: each of `concurrency` workers sends its next request when its last one ends,
    every other one streamed, until duration_s has passed."""
    ledger, origin = Ledger(), time.perf_counter()

    async def worker(first: int) -> None:
        for i in itertools.count(first, concurrency):
            if time.perf_counter() - origin >= duration_s:
                return
            planned = Planned(prompts[i % len(prompts)], streamed=i % 2 == 0)
            record = await tracked(session, target, planned, ledger, origin)
            if record is None or record.outcome != OK:
                await asyncio.sleep(CAPACITY_BACKOFF_S)

    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return Capacity(completion_rate(ledger.done(), duration_s), True, duration_s, concurrency), ledger


# ---- the overload phase ----


@dataclass(frozen=True)
class LoadSettings:
    rate: float  # arrivals per second
    duration_s: float
    cancel_fraction: float
    cancel_delay_max_s: float  # a cancelled request is given up uniformly within [0, this] after sending
    stream_fraction: float
    max_outstanding: int
    max_requests: int
    seed: int


@dataclass(frozen=True)
class LoadResult:
    ledger: Ledger
    arrivals_s: float  # from the first arrival to the last one sent or dropped
    elapsed_s: float  # from the start to the end of the last request
    dropped: int  # arrivals not sent: --max-outstanding requests were in flight
    cancels_planned: int


def arrival_offsets(load: LoadSettings) -> np.ndarray:
    """Poisson arrival times within the duration, at most max_requests of them. Enough are drawn
    that the duration, not the draw, ends them: the count is Poisson, its spread sqrt(mean)."""
    expected = load.rate * load.duration_s
    n = min(load.max_requests, math.ceil(expected + 10 * math.sqrt(expected) + 10))
    offsets = ArrivalProcess(load.rate).offsets(n, load.seed)
    return offsets[offsets < load.duration_s]


def plan(request: RequestInput, rng: random.Random, load: LoadSettings) -> Planned:
    streamed = rng.random() < load.stream_fraction
    cancel = rng.random() < load.cancel_fraction
    return Planned(request, streamed, rng.uniform(0, load.cancel_delay_max_s) if cancel else None)


async def overload(
    session: aiohttp.ClientSession, target: Target, prompts: Sequence[RequestInput], load: LoadSettings,
) -> LoadResult:
    ledger, rng, origin = Ledger(), random.Random(load.seed), time.perf_counter()
    tasks: set[asyncio.Task] = set()
    dropped = cancels = 0
    for i, offset in enumerate(arrival_offsets(load)):
        if (delay := origin + offset - time.perf_counter()) > 0:
            await asyncio.sleep(delay)
        if ledger.in_flight >= load.max_outstanding:
            dropped += 1
            continue
        planned = plan(prompts[i % len(prompts)], rng, load)
        cancels += planned.cancel_after_s is not None
        task = asyncio.create_task(tracked(session, target, planned, ledger, origin))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    arrivals_s = time.perf_counter() - origin
    await asyncio.gather(*tasks)
    return LoadResult(ledger, arrivals_s, time.perf_counter() - origin, dropped, cancels)


# ---- the server's memory ----


@dataclass(frozen=True)
class RssSample:
    t_s: float  # seconds after the overload began
    server_bytes: int
    children_bytes: int  # all descendants: the engine process, multiprocessing's resource tracker

    @property
    def total_bytes(self) -> int:
        return self.server_bytes + self.children_bytes


def vm_rss_bytes(pid: int) -> int | None:
    """None once the process is gone (or a zombie, which has no VmRSS line)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024  # the kernel says kB and means KiB
    return None


def descendants(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        for task in Path(f"/proc/{stack.pop()}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue  # the task ended while we looked
            found += children
            stack += children
    return found


def rss_sample(pid: int, t_s: float) -> RssSample | None:
    server = vm_rss_bytes(pid)
    if server is None:
        return None
    children = sum(rss or 0 for rss in map(vm_rss_bytes, descendants(pid)))
    return RssSample(t_s, server, children)


async def sample_rss(pid: int, interval_s: float, origin: float, samples: list[RssSample]) -> None:
    """Append a sample every interval_s until cancelled, or until the process is gone."""
    while (sample := rss_sample(pid, time.perf_counter() - origin)) is not None:
        samples.append(sample)
        await asyncio.sleep(interval_s)


@dataclass(frozen=True)
class RssTrend:
    warm_mib: float  # the first sample after warm-up
    end_mib: float  # the last sample of the load
    slope_mib_per_10min: float  # least squares over the samples between the two
    samples: int


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The least-squares slope of ys over xs."""
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    dx = x - x.mean()
    return float((dx * (y - y.mean())).sum() / (dx * dx).sum())


def rss_trend(samples: Sequence[RssSample], start_s: float, end_s: float) -> RssTrend | None:
    """Server plus descendants, between start_s (the end of warm-up) and end_s (the end of the
    load); None with fewer than two samples there."""
    window = [s for s in samples if start_s <= s.t_s <= end_s]
    if len(window) < 2 or window[0].t_s == window[-1].t_s:
        return None
    per_second = slope([s.t_s for s in window], [s.total_bytes for s in window])
    return RssTrend(window[0].total_bytes / MIB, window[-1].total_bytes / MIB, per_second * 600 / MIB, len(window))


# ---- Retry-After truth ----


@dataclass(frozen=True)
class RetryAfterTruth:
    rejections: int  # 429s
    invalid: int  # 429s whose Retry-After is missing or not an integer >= 1
    compared: int  # 429s with an ok neighbour
    median: float | None  # of R / measured wait
    p5: float | None
    p95: float | None
    within_2x: float | None  # fraction of the compared with 0.5 <= R / wait <= 2


def retry_after_ratios(records: Sequence[Record], window_s: float = NEIGHBOUR_WINDOW_S) -> list[float]:
    """For each 429 with a Retry-After R: R / the mean latency of the ok requests sent within
    window_s of it; a 429 without such a neighbour is skipped."""
    ok = sorted((r.sent_at, r.latency) for r in records if r.outcome == OK)
    times = [t for t, _ in ok]
    sums = np.concatenate([[0.0], np.cumsum([latency for _, latency in ok])])  # sums[i]: of the first i
    ratios = []
    for r in records:
        seconds = retry_after_seconds(r.retry_after) if r.outcome == REJECTED_429 else None
        lo, hi = bisect.bisect_left(times, r.sent_at - window_s), bisect.bisect_right(times, r.sent_at + window_s)
        if seconds is not None and hi > lo:
            ratios.append(seconds / ((sums[hi] - sums[lo]) / (hi - lo)))
    return ratios


def retry_after_truth(records: Sequence[Record]) -> RetryAfterTruth:
    rejected = [r for r in records if r.outcome == REJECTED_429]
    invalid = sum((retry_after_seconds(r.retry_after) or 0) < 1 for r in rejected)
    ratios = np.asarray(retry_after_ratios(records))
    if not ratios.size:
        return RetryAfterTruth(len(rejected), invalid, 0, None, None, None, None)
    p5, median, p95 = (float(v) for v in np.percentile(ratios, [5, 50, 95]))
    within = float(((ratios >= 0.5) & (ratios <= 2)).mean())
    return RetryAfterTruth(len(rejected), invalid, int(ratios.size), median, p5, p95, within)


# ---- the gauges after ----


@dataclass(frozen=True)
class GaugesAfter:
    values: dict[str, float]  # the last reading; a gauge missing from it was not exported
    zero: bool
    waited_s: float


def parse_gauges(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in GAUGES}


async def read_gauges(session: aiohttp.ClientSession, target: Target) -> dict[str, float]:
    url = target.base_url.rstrip("/") + "/metrics"
    try:
        async with session.get(url, headers=target.headers, timeout=aiohttp.ClientTimeout(total=10)) as response:
            return parse_gauges(await response.text()) if response.status == 200 else {}
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return {}


async def wait_for_idle_gauges(session: aiohttp.ClientSession, target: Target, timeout_s: float) -> GaugesAfter:
    """Poll /metrics until running, waiting and KV cache usage are all 0, or timeout_s passes."""
    start = time.perf_counter()
    while True:
        values = await read_gauges(session, target)
        zero = len(values) == len(GAUGES) and all(v == 0 for v in values.values())
        waited = time.perf_counter() - start
        if zero or waited >= timeout_s:
            return GaugesAfter(values, zero, waited)
        await asyncio.sleep(0.5)


# ---- the result ----


@dataclass(frozen=True)
class Checks:
    exactly_one_outcome: bool
    no_5xx_but_503: bool
    no_stream_errors: bool
    retry_after_valid: bool
    gauges_zero_after: bool
    rss_flat: bool | None  # None: not sampled

    @property
    def passed(self) -> bool:
        return all(v is not False for v in asdict(self).values())


def checks(
    ledgers: Sequence[Ledger], truth: RetryAfterTruth, gauges: GaugesAfter, rss: RssTrend | None,
    max_rss_slope: float, rss_sampled: bool,
) -> Checks:
    outcomes = Counter(r.outcome for ledger in ledgers for r in ledger.done())
    return Checks(
        exactly_one_outcome=all(ledger.accounting().exactly_one for ledger in ledgers),
        no_5xx_but_503=not any(is_bad_5xx(o) for o in outcomes),
        no_stream_errors=outcomes[STREAM_ERROR] == 0 and outcomes[INCOMPLETE] == 0,
        retry_after_valid=truth.invalid == 0,
        gauges_zero_after=gauges.zero,
        rss_flat=None if not rss_sampled else rss is not None and rss.slope_mib_per_10min < max_rss_slope,
    )


def _phase(ledger: Ledger) -> dict:
    return {"outcomes": ledger.counts(), "accounting": asdict(ledger.accounting())}


def _latency_ms(records: Sequence[Record]) -> dict | None:
    distribution = Distribution.of([r.latency for r in records if r.outcome == OK], (90, 99))
    if distribution is None:
        return None
    return {"mean": distribution.mean, "median": distribution.median,
            **{f"p{p:g}": v for p, v in distribution.percentiles}}


def _requests(records: Sequence[Record]) -> dict:
    """Per request, in the order sent: the figures to recompute anything above from."""
    return {key: [getattr(r, key) for r in records] for key in ("outcome", "sent_at", "latency", "streamed",
                                                                 "retry_after")}


@dataclass(frozen=True)
class SoakRun:
    model: str
    capacity: Capacity
    capacity_ledger: Ledger | None
    load_settings: LoadSettings
    load: LoadResult
    gauges: GaugesAfter
    rss_samples: list[RssSample]


def _load_summary(settings: LoadSettings, load: LoadResult) -> dict:
    ok = sum(r.outcome == OK for r in load.ledger.done())
    return {
        "offered_rate": settings.rate, "arrivals_s": load.arrivals_s, "elapsed_s": load.elapsed_s,
        "sent": load.ledger.sent, "achieved_rate": load.ledger.sent / load.arrivals_s if load.arrivals_s else 0.0,
        "dropped_client_side": load.dropped, "cancels_planned": load.cancels_planned,
        "ok_per_s": ok / load.elapsed_s if load.elapsed_s else 0.0, **_phase(load.ledger),
    }


def summarize(run: SoakRun, settings: dict, warmup_fraction: float, max_rss_slope: float) -> dict:
    records = run.load.ledger.done()
    duration = run.load_settings.duration_s
    rss = rss_trend(run.rss_samples, warmup_fraction * duration, duration)
    truth = retry_after_truth(records)
    ledgers = [run.load.ledger] + ([run.capacity_ledger] if run.capacity_ledger else [])
    verdict = checks(ledgers, truth, run.gauges, rss, max_rss_slope, settings["server_pid"] is not None)
    return {
        **settings,
        "capacity": {**asdict(run.capacity), **(_phase(run.capacity_ledger) if run.capacity_ledger else {})},
        "load": _load_summary(run.load_settings, run.load),
        "ok_latency_ms": _latency_ms(records),
        "retry_after": asdict(truth),
        "rss": {"trend": None if rss is None else asdict(rss), "warmup_s": warmup_fraction * duration,
                "max_slope_mib_per_10min": max_rss_slope,
                "samples": [[s.t_s, s.server_bytes, s.children_bytes] for s in run.rss_samples]},
        "gauges_after": asdict(run.gauges),
        "checks": asdict(verdict),
        "passed": verdict.passed,
        "requests": _requests(records),
    }


def format_report(summary: dict) -> str:
    rows = [f"{' Soak Benchmark Result ':=^64}"]
    row = lambda label, value: rows.append(f"{label:<40} {value}")  # noqa: E731
    capacity, load = summary["capacity"], summary["load"]
    how = f"closed loop of {capacity['concurrency']} for {capacity['duration_s']:g} s" if capacity["measured"] \
        else "given"
    row("Capacity (req/s):", f"{capacity['per_second']:.2f} ({how})")
    row("Offered rate (req/s):", f"{load['offered_rate']:.2f} ({summary['overload']:g} x capacity, Poisson)")
    row("Achieved rate (req/s):", f"{load['achieved_rate']:.2f} over {load['arrivals_s']:.1f} s")
    row("Requests sent:", load["sent"])
    row("Dropped client-side (outstanding cap):", load["dropped_client_side"])
    row("Cancels planned:", load["cancels_planned"])
    _outcome_rows(rows, row, load)
    row("Goodput (ok req/s):", f"{load['ok_per_s']:.2f}")
    if latency := summary["ok_latency_ms"]:
        row("ok latency mean / p50 / p99 (ms):", f"{latency['mean']:.0f} / {latency['median']:.0f} / "
                                                 f"{latency['p99']:.0f}")
    _retry_after_rows(rows, row, summary["retry_after"])
    _rss_rows(rows, row, summary)
    gauges = summary["gauges_after"]
    rows.append(f"{' Gauges after ':-^64}")
    for name in GAUGES:
        row(f"{name}:", gauges["values"].get(name, "missing"))
    row("Back to 0:", f"{'yes' if gauges['zero'] else 'NO'} (after {gauges['waited_s']:.1f} s)")
    rows.append(f"{' Checks ':-^64}")
    for name, value in summary["checks"].items():
        row(f"{name}:", {True: "PASS", False: "FAIL", None: "not checked"}[value])
    rows.append("=" * 64)
    return "\n".join(rows)


def _outcome_rows(rows: list[str], row, load: dict) -> None:
    rows.append(f"{' Outcomes ':-^64}")
    for outcome, count in load["outcomes"].items():
        row(f"{outcome}:", f"{count} ({count / max(load['sent'], 1):.1%})")
    accounting = load["accounting"]
    one = "exactly one each" if Accounting(**accounting).exactly_one else \
        f"{accounting['without_outcome']} without, {accounting['recorded_twice']} recorded twice"
    row("Sum of outcomes:", f"{accounting['outcomes']} of {accounting['sent']} sent ({one})")


def _retry_after_rows(rows: list[str], row, truth: dict) -> None:
    rows.append(f"{' Retry-After truth (R / measured wait) ':-^64}")
    row("429s, compared (with an ok neighbour):", f"{truth['rejections']}, {truth['compared']}")
    if truth["compared"]:
        row("median [p5, p95]:", f"{truth['median']:.2f} [{truth['p5']:.2f}, {truth['p95']:.2f}]")
        row("within 2x (0.5 <= ratio <= 2):", f"{truth['within_2x']:.1%}")


def _rss_rows(rows: list[str], row, summary: dict) -> None:
    rows.append(f"{' Server RSS (server + engine) ':-^64}")
    trend = summary["rss"]["trend"]
    if summary["server_pid"] is None:
        row("not sampled:", "pass --server-pid")
    elif trend is None:
        row("too few samples:", len(summary["rss"]["samples"]))
    else:
        row(f"after warm-up ({summary['rss']['warmup_s']:.0f} s) (MiB):", f"{trend['warm_mib']:.1f}")
        row("at the end (MiB):", f"{trend['end_mib']:.1f}")
        row("slope (MiB per 10 min):", f"{trend['slope_mib_per_10min']:+.2f} ({trend['samples']} samples)")


# ---- from the command line ----


@dataclass(frozen=True)
class Options:
    capacity: float | None
    capacity_duration_s: float
    capacity_concurrency: int
    overload: float
    load: LoadSettings  # its rate is a placeholder until the capacity is known
    server_pid: int | None
    rss_interval_s: float
    warmup_fraction: float
    max_rss_slope: float
    gauge_timeout_s: float


def check_loopback(base_url: str) -> None:
    host = urlsplit(base_url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise ValueError(f"--base-url {base_url!r} is not a loopback address: the soak overloads its server on "
                         "purpose, and reads the server's memory from this machine's /proc")


def parse_options(args: argparse.Namespace) -> Options:
    check_loopback(args.base_url)
    positive = {"--overload": args.overload, "--duration": args.duration, "--timeout": args.timeout,
                "--capacity-duration": args.capacity_duration, "--rss-interval": args.rss_interval,
                "--capacity": 1.0 if args.capacity is None else args.capacity}
    for name, value in positive.items():
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be positive and finite, not {value}")
    if not args.cancel_delay_max >= 0:
        raise ValueError(f"--cancel-delay-max must be >= 0, not {args.cancel_delay_max}")
    for name, value in (("--cancel-fraction", args.cancel_fraction), ("--stream-fraction", args.stream_fraction),
                        ("--warmup-fraction", args.warmup_fraction)):
        if not 0 <= value <= 1:
            raise ValueError(f"{name} must be in [0, 1], not {value}")
    if min(args.max_outstanding, args.max_requests, args.capacity_concurrency, args.num_prompts) < 1:
        raise ValueError("--max-outstanding, --max-requests, --capacity-concurrency and --num-prompts must be >= 1")
    if args.server_pid is not None and vm_rss_bytes(args.server_pid) is None:
        raise ValueError(f"--server-pid {args.server_pid}: no such process on this machine")
    load = LoadSettings(0.0, args.duration, args.cancel_fraction, args.cancel_delay_max, args.stream_fraction,
                        args.max_outstanding, args.max_requests, args.seed)
    return Options(args.capacity, args.capacity_duration, args.capacity_concurrency, args.overload, load,
                   args.server_pid, args.rss_interval, args.warmup_fraction, args.max_rss_slope, args.gauge_timeout)


def make_prompts(args: argparse.Namespace) -> list[RequestInput]:
    """A pool of --num-prompts random prompts, sent in turn (a long soak sends each many times)."""
    from ferry.assets import default_model_path

    maker = PromptMaker(load_tokenizer(args.tokenizer or default_model_path()))
    config = WorkloadConfig("random", args.num_prompts, Lengths(args.random_input_len, args.random_output_len),
                            seed=args.seed)
    chat = Api.of_endpoint(args.endpoint) is Api.CHAT
    turns = [c.turns[0] for c in make_workload(config, maker)]
    return [RequestInput(({"role": "user", "content": t.prompt},) if chat else t.prompt, t.prompt_len, t.output_len)
            for t in turns]


async def run_soak(args: argparse.Namespace, options: Options, prompts: list[RequestInput]) -> SoakRun:
    # Connections up to the outstanding cap (plus the capacity loop's and /metrics'); idle ones are
    # dropped after 3 s, before the server drops them (see serve.py).
    limit = max(options.load.max_outstanding, options.capacity_concurrency) + 8
    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=3)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        headers = Target(args.base_url, args.endpoint, "", args.api_key).headers
        model = args.model or await first_model(session, args.base_url, headers)
        target = Target(args.base_url, args.endpoint, model, args.api_key, args.timeout, ignore_eos=True)
        capacity, capacity_ledger = await _capacity(session, target, prompts, options)
        if not capacity.per_second > 0:
            raise ServerUnreachable("no request completed in the capacity phase: " + str(capacity_ledger.counts()))
        load = LoadSettings(**{**asdict(options.load), "rate": options.overload * capacity.per_second})
        print(f"capacity {capacity.per_second:.2f} req/s; overload at {load.rate:.2f} req/s for "
              f"{load.duration_s:g} s", file=sys.stderr, flush=True)
        samples: list[RssSample] = []
        sampler = asyncio.create_task(sample_rss(options.server_pid, options.rss_interval_s, time.perf_counter(),
                                                 samples)) if options.server_pid is not None else None
        result = await overload(session, target, prompts, load)
        gauges = await wait_for_idle_gauges(session, target, options.gauge_timeout_s)
        if sampler is not None:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        return SoakRun(model, capacity, capacity_ledger, load, result, gauges, samples)


async def _capacity(
    session: aiohttp.ClientSession, target: Target, prompts: Sequence[RequestInput], options: Options,
) -> tuple[Capacity, Ledger | None]:
    if options.capacity is not None:
        return Capacity(options.capacity, measured=False), None
    print(f"measuring capacity: closed loop of {options.capacity_concurrency} for {options.capacity_duration_s:g} s",
          file=sys.stderr, flush=True)
    return await measure_capacity(session, target, prompts, options.capacity_concurrency,
                                  options.capacity_duration_s)


def _settings(args: argparse.Namespace, model: str) -> dict:
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "base_url": args.base_url,
        "endpoint": args.endpoint, "model": model, "server_pid": args.server_pid,
        "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
        "num_prompts": args.num_prompts, "overload": args.overload, "duration_s": args.duration,
        "cancel_fraction": args.cancel_fraction, "cancel_delay_max_s": args.cancel_delay_max,
        "stream_fraction": args.stream_fraction, "max_outstanding": args.max_outstanding,
        "max_requests": args.max_requests, "timeout_s": args.timeout, "seed": args.seed,
    }


def main_from_args(args: argparse.Namespace) -> int:
    """0 when every check passed, 1 when one failed, 2 when the server could not be measured."""
    options = parse_options(args)
    prompts = make_prompts(args)
    try:
        run = asyncio.run(run_soak(args, options, prompts))
    except ServerUnreachable as e:
        print(f"ferry bench soak: error: {e}", file=sys.stderr)
        return 2
    summary = summarize(run, _settings(args, run.model), options.warmup_fraction, options.max_rss_slope)
    print(format_report(summary), flush=True)
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(summary, indent=1, allow_nan=False))
        print(f"wrote {args.result_file}")
    return 0 if summary["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    from ferry.bench.cli import add_soak_args

    parser = argparse.ArgumentParser(prog="python -m ferry.bench.soak", description=__doc__.split("\n")[0])
    add_soak_args(parser)
    args = parser.parse_args(argv)
    try:
        return main_from_args(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ferry bench soak: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
