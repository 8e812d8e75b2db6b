"""Batching policies compared: one arrival trace served by static, dynamic and continuous batching.

    ferry bench policies --num-prompts 64 --request-rate 6 --input-len 32 256 --output-len 16 128
    ferry bench policies --input-len 144 --output-len 72 --plot-dir plots --json policies.json

Every policy serves the same trace on a fresh engine, in this process, in wall time:

    static                         the next --batch-size requests, once that many have arrived, run
                                   until every one of them has finished; only then the next batch
                                   (a request that finishes early leaves its slot idle)
    dynamic                        as static, but a batch starts when --batch-size requests wait or
                                   the oldest has waited --batch-timeout seconds
    continuous                     every request goes to the engine as it arrives, and ferry's
                                   scheduler joins it to the running batch at the next step, its
                                   prompt cut into chunks that share steps with decodes
    continuous-no-chunked-prefill  the same, with --no-enable-chunked-prefill: a step prefills whole
                                   prompts alone, and the decodes wait for it

Static and dynamic batching decide only when requests are handed to the engine; the engine then
batches whatever it holds, scheduled as the engine's options say. The trace is Poisson arrivals at
--request-rate, random token-id prompts and output lengths fixed or uniform in a range
(`--input-len LO HI`), seeded by the engine's `--seed`, and EOS ignored, so that every policy
computes the same tokens. A request is handed over once its arrival time has passed; when the
engine holds nothing to run, the replay sleeps until the next arrival (or the end of the oldest's
--batch-timeout).

Times are taken as each step's outputs come out of `engine.step()` (RequestOutputKind.DELTA); the
tokens of one step share its time. Per request, from its arrival: TTFT to its first token, E2E to
its last, and the gaps between its consecutive tokens (ITL); its mean ITL is (E2E - TTFT) / (tokens
- 1). Per policy, over the makespan (the trace's start to the last token): output tokens per
second, requests per second, and goodput, the requests per second that met both --ttft-slo and
--itl-slo (on their mean ITL).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from ferry.bench.arrivals import ArrivalProcess
from ferry.bench.roofline import RecordedStep, ScheduleRecorder
from ferry.bench.throughput import (
    build_engine, command_line, length_range, print_results, random_workload, resolve_model_args,
)
from ferry.engine_args import add_engine_args, engine_kwargs

NUM_WARMUP_PROMPTS = 2  # short requests each fresh engine runs before the trace (first steps are slow)


# ---- the trace ----


@dataclass(frozen=True)
class Trace:
    arrivals: list[float]  # seconds after the start, ascending
    prompts: list[list[int]]
    output_lens: list[int]  # tokens each request generates (EOS ignored)


def make_trace(args: argparse.Namespace, vocab_size: int) -> Trace:
    input_len, output_len = length_range(args.input_len, "input-len"), length_range(args.output_len, "output-len")
    prompts, output_lens = random_workload(args.num_prompts, input_len, output_len, vocab_size, args.seed)
    arrivals = ArrivalProcess(args.request_rate).offsets(args.num_prompts, args.seed)
    return Trace([float(a) for a in arrivals], prompts, output_lens)


# ---- when waiting requests go to the engine ----


class Gate(Protocol):
    # The longest a request waits to be handed over while the engine is idle (the replay sleeps
    # until the next arrival or the end of the oldest's wait).
    timeout: float

    def release(self, num_waiting: int, oldest_wait: float, more_to_come: bool, engine_busy: bool) -> int:
        """How many of the waiting requests (oldest first) to hand to the engine now."""


class Continuous:
    """Every request as it arrives: the engine's scheduler batches at the level of single steps."""

    timeout = 0.0

    def release(self, num_waiting: int, oldest_wait: float, more_to_come: bool, engine_busy: bool) -> int:
        return num_waiting


@dataclass(frozen=True)
class Batches:
    """A batch at a time: up to `batch_size` requests, handed over only when the engine has finished
    the last batch, once `batch_size` wait, the oldest has waited `timeout` seconds, or the trace has
    no more to come. Static batching has no timeout: its batches are full, all but the trace's last."""

    batch_size: int
    timeout: float = math.inf

    def release(self, num_waiting: int, oldest_wait: float, more_to_come: bool, engine_busy: bool) -> int:
        if engine_busy or not num_waiting:
            return 0
        if num_waiting >= self.batch_size or oldest_wait >= self.timeout or not more_to_come:
            return min(num_waiting, self.batch_size)
        return 0


@dataclass(frozen=True)
class Policy:
    name: str
    gate: Gate
    chunked_prefill: bool | None  # the scheduler's mode; None: as the engine's options say


def make_policies(batch_size: int, batch_timeout: float) -> dict[str, Policy]:
    return {policy.name: policy for policy in (
        Policy("static", Batches(batch_size), None),
        Policy("dynamic", Batches(batch_size, batch_timeout), None),
        Policy("continuous", Continuous(), True),
        Policy("continuous-no-chunked-prefill", Continuous(), False),
    )}


POLICY_NAMES = tuple(make_policies(1, 0.0))


# ---- one policy's run ----


@dataclass
class RequestTimes:
    """One request's times, in seconds after the trace's start."""

    arrival: float
    handed_over: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per token, as its step's output came out
    finish: float | None = None

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def itls(self) -> list[float]:
        return np.diff(self.token_times).tolist()

    @property
    def mean_itl(self) -> float:
        """(E2E - TTFT) / (tokens - 1); 0 for a single token (as vLLM's TPOT)."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else 0.0


class Replay(NamedTuple):
    requests: list[RequestTimes]
    handovers: list[tuple[float, list[int]]]  # (when, the requests handed to the engine together)
    steps: list[RecordedStep]
    start: float  # the trace's start, on the clock of the steps' scheduled_at (time.perf_counter)
    idle: list[float]  # when the engine was found with nothing to run, after the start


def replay(engine, trace: Trace, gate: Gate) -> Replay:
    """Serve the trace in wall time: arrivals join a queue, the gate hands them to the engine, and
    the engine steps while it holds anything (otherwise the replay sleeps until the next event)."""
    n = len(trace.arrivals)
    requests = [RequestTimes(arrival) for arrival in trace.arrivals]
    waiting: deque[int] = deque()
    handovers, idle = [], []
    arrived = finished = 0
    with ScheduleRecorder(engine) as steps:
        start = time.perf_counter()
        while finished < n:
            now = time.perf_counter() - start
            while arrived < n and trace.arrivals[arrived] <= now:
                waiting.append(arrived)
                arrived += 1
            oldest_wait = now - trace.arrivals[waiting[0]] if waiting else 0.0
            count = gate.release(len(waiting), oldest_wait, arrived < n, engine.has_unfinished_requests())
            if count:
                batch = [waiting.popleft() for _ in range(count)]
                _hand_over(engine, trace, batch, requests, now)
                handovers.append((now, batch))
            if engine.has_unfinished_requests():
                outputs = engine.step()
                finished += _record(outputs, requests, time.perf_counter() - start)
            else:
                idle.append(now)
                next_event = min(trace.arrivals[arrived] if arrived < n else math.inf,
                                 trace.arrivals[waiting[0]] + gate.timeout if waiting else math.inf)
                time.sleep(max(0.0, next_event - (time.perf_counter() - start)))
    return Replay(requests, handovers, steps, start, idle)


def _hand_over(engine, trace: Trace, batch: list[int], requests: list[RequestTimes], now: float) -> None:
    from ferry.sampling_params import RequestOutputKind, SamplingParams

    for i in batch:
        params = SamplingParams(temperature=0.0, max_tokens=trace.output_lens[i], ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        engine.add_request(str(i), {"prompt_token_ids": trace.prompts[i]}, params)
        requests[i].handed_over = now


def _record(outputs: Iterable, requests: list[RequestTimes], now: float) -> int:
    """Stamp the step's new tokens with `now`; returns how many requests finished."""
    finished = 0
    for output in outputs:
        request = requests[int(output.request_id)]
        request.token_times += [now] * len(output.outputs[0].token_ids)
        if output.finished:
            request.finish = now
            finished += 1
    return finished


def warm_up(engine, trace: Trace, vocab_size: int, seed: int) -> None:
    """A few short requests of the trace's longest prompt length (not of its prompts: those would
    then hit the prefix cache), so that the trace does not pay the engine's first steps."""
    from ferry.sampling_params import SamplingParams

    length = max(map(len, trace.prompts))
    prompts, _ = random_workload(NUM_WARMUP_PROMPTS, (length, length), (1, 1), vocab_size, seed + 1)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"warmup-{i}", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


# ---- figures ----


class Slo(NamedTuple):
    ttft_s: float
    itl_s: float  # on a request's mean ITL

    def met(self, request: RequestTimes) -> bool:
        return request.ttft <= self.ttft_s and request.mean_itl <= self.itl_s


def _ms(seconds: Iterable[float], *percentiles: int) -> dict[str, float]:
    """Mean and percentiles, in milliseconds."""
    values = np.asarray(list(seconds), dtype=float) * 1000
    return {"mean": float(values.mean()), **{f"p{p}": float(np.percentile(values, p)) for p in percentiles}}


def summarize(policy: Policy, run: Replay, trace: Trace, slo: Slo, num_preemptions: int) -> dict:
    requests = run.requests
    makespan = max(r.token_times[-1] for r in requests)
    output_tokens = sum(len(r.token_times) for r in requests)
    good = sum(slo.met(r) for r in requests)
    return {
        "policy": policy.name,
        "makespan_s": makespan,
        "output_tokens": output_tokens,
        "complete": [len(r.token_times) for r in requests] == trace.output_lens,
        "output_throughput": output_tokens / makespan,
        "request_throughput": len(requests) / makespan,
        "goodput": good / makespan,
        "good_requests": good,
        "ttft_ms": _ms((r.ttft for r in requests), 50, 99),
        "itl_ms": _ms((gap for r in requests for gap in r.itls), 99),
        "e2e_ms": _ms((r.e2e for r in requests), 50, 99),
        "num_steps": len(run.steps),
        "num_preemptions": num_preemptions,
        "handovers": [{"at_s": at, "requests": batch} for at, batch in run.handovers],
        "timeline": timeline(run),
        "requests": [{"arrival_s": r.arrival, "handed_over_s": r.handed_over, "first_token_s": r.token_times[0],
                      "finish_s": r.finish, "output_tokens": len(r.token_times), "ttft_s": r.ttft,
                      "mean_itl_s": r.mean_itl, "e2e_s": r.e2e, "itls_s": r.itls, "met_slo": slo.met(r)}
                     for r in requests],
    }


def timeline(run: Replay) -> list[dict]:
    """The running batch over time: the requests each step ran (of them, those computing more than
    one token: prompts), and 0 where the engine was found idle."""
    points = [{"t_s": s.scheduled_at - run.start, "requests": len(s.step), "prefilling": sum(q > 1 for q, _ in s.step)}
              for s in run.steps]
    points += [{"t_s": t, "requests": 0, "prefilling": 0} for t in run.idle]
    return sorted(points, key=lambda p: p["t_s"])


# ---- the lab ----


def run(args: argparse.Namespace) -> dict:
    """Every policy asked for, each on a fresh engine, over the same trace. The engines' configs
    are all made first, so that an option one of them refuses fails before any run."""
    resolve_model_args(args)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    if args.plot_dir:
        from ferry.bench.plots import require_matplotlib

        require_matplotlib()
    policies = [make_policies(args.batch_size, args.batch_timeout)[name] for name in args.policies]
    configs = [_engine_config(args, policy) for policy in policies]
    trace = make_trace(args, configs[0].model.vocab_size)
    slo = Slo(args.ttft_slo / 1000, args.itl_slo / 1000)
    return {
        "model": str(args.model), "device": args.device, "threads": args.threads,
        "trace": {"num_requests": len(trace.arrivals), "request_rate": args.request_rate,
                  "last_arrival_s": trace.arrivals[-1], "input_len": length_range(args.input_len, "input-len"),
                  "output_len": length_range(args.output_len, "output-len"), "seed": args.seed,
                  "input_tokens": sum(map(len, trace.prompts)), "output_tokens": sum(trace.output_lens)},
        "batch_size": args.batch_size, "batch_timeout_s": args.batch_timeout,
        "ttft_slo_ms": args.ttft_slo, "itl_slo_ms": args.itl_slo,
        "policies": [serve(args, policy, config, trace, slo) for policy, config in zip(policies, configs)],
    }


def _engine_config(args: argparse.Namespace, policy: Policy):
    from ferry.config import EngineConfig

    options = engine_kwargs(args)
    if policy.chunked_prefill is not None:
        options["enable_chunked_prefill"] = policy.chunked_prefill
    return EngineConfig.create(args.model, **options)


def serve(args: argparse.Namespace, policy: Policy, config, trace: Trace, slo: Slo) -> dict:
    """One policy's figures, on an engine of its own (warmed up, then the trace)."""
    engine = build_engine(args, config)
    warm_up(engine, trace, config.model.vocab_size, args.seed)
    preemptions_before = engine.scheduler.num_preemptions
    outcome = replay(engine, trace, policy.gate)
    engine.shutdown()
    return summarize(policy, outcome, trace, slo, engine.scheduler.num_preemptions - preemptions_before)


def report(r: dict) -> str:
    t = r["trace"]
    lines = [
        f"{r['model']} on {r['device']}",
        f"trace: {t['num_requests']} requests, Poisson at {t['request_rate']:g} req/s (last arrival at "
        f"{t['last_arrival_s']:.1f} s), prompts {_span(t['input_len'])} tokens, outputs {_span(t['output_len'])} "
        f"tokens ({t['output_tokens']:,} in all), seed {t['seed']}",
        f"batches of {r['batch_size']} (dynamic: or once the oldest has waited {r['batch_timeout_s']:g} s); "
        f"goodput: requests with TTFT <= {r['ttft_slo_ms']:g} ms and mean ITL <= {r['itl_slo_ms']:g} ms",
        "",
        f"{'policy':<30} {'out tok/s':>9} {'req/s':>6} {'goodput':>7} | {'TTFT ms: mean':>13} {'p50':>6} {'p99':>6} | "
        f"{'ITL ms: mean':>12} {'p99':>6} | {'E2E ms: mean':>12} {'p99':>6}",
    ]
    for p in r["policies"]:
        ttft, itl, e2e = p["ttft_ms"], p["itl_ms"], p["e2e_ms"]
        lines.append(
            f"{p['policy']:<30} {p['output_throughput']:>9.1f} {p['request_throughput']:>6.2f} "
            f"{p['goodput']:>7.2f} | {ttft['mean']:>13.0f} {ttft['p50']:>6.0f} {ttft['p99']:>6.0f} | "
            f"{itl['mean']:>12.1f} {itl['p99']:>6.1f} | {e2e['mean']:>12.0f} {e2e['p99']:>6.0f}")
    lines += [f"warning: {p['policy']}: {p['output_tokens']:,} output tokens, {t['output_tokens']:,} expected"
              for p in r["policies"] if not p["complete"]]
    return "\n".join(lines)


def _span(lengths: tuple[int, int]) -> str:
    lo, hi = lengths
    return str(lo) if lo == hi else f"{lo}-{hi}"


# ---- plots ----


def write_plots(r: dict, out_dir: Path) -> list[Path]:
    """throughput.png (bars), latency_cdfs.png (TTFT and ITL) and batch_timeline.png."""
    from ferry.bench import plots

    plt = plots._pyplot()
    return [plots._save(fig, plt, out_dir / name) for name, fig in (
        ("throughput.png", _throughput_figure(plt, r["policies"])),
        ("latency_cdfs.png", _latency_figure(plt, r["policies"])),
        ("batch_timeline.png", _timeline_figure(plt, r["policies"])),
    )]


def _throughput_figure(plt, policies: list[dict]):
    names = [p["policy"] for p in policies]
    x = np.arange(len(names))
    fig, (tokens, requests) = plt.subplots(1, 2, figsize=(12, 4.5))
    tokens.bar(x, [p["output_throughput"] for p in policies], color="tab:blue")
    tokens.set_title("output tokens/s")
    requests.bar(x - 0.2, [p["request_throughput"] for p in policies], 0.4, label="requests/s")
    requests.bar(x + 0.2, [p["goodput"] for p in policies], 0.4, label="goodput (within both SLOs)")
    requests.set_title("requests/s")
    requests.legend(fontsize="small")
    for ax in (tokens, requests):
        ax.set_xticks(x, names, rotation=15, fontsize="small")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def _latency_figure(plt, policies: list[dict]):
    fig, (ttft, itl) = plt.subplots(1, 2, figsize=(12, 4.5))
    for p in policies:
        for ax, seconds in ((ttft, [r["ttft_s"] for r in p["requests"]]),
                            (itl, [gap for r in p["requests"] for gap in r["itls_s"]])):
            ms = np.sort(np.asarray(seconds, dtype=float)) * 1000
            ax.step(ms, np.arange(1, ms.size + 1) / max(ms.size, 1), where="post", label=p["policy"])
    for ax, name in ((ttft, "TTFT"), (itl, "ITL")):
        ax.set_title(f"{name} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction")
        ax.set_xscale("symlog")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def _timeline_figure(plt, policies: list[dict]):
    fig, axes = plt.subplots(len(policies), 1, figsize=(12, 2.2 * len(policies)), sharex=True, squeeze=False)
    for ax, p in zip(axes[:, 0], policies):
        t = [point["t_s"] for point in p["timeline"]]
        ax.step(t, [point["requests"] for point in p["timeline"]], where="post", label="requests in the step")
        ax.step(t, [point["prefilling"] for point in p["timeline"]], where="post", label="of them prefilling")
        ax.set_title(p["policy"], fontsize="small")
        ax.set_ylabel("batch")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize="small")
    axes[-1, 0].set_xlabel("seconds after the trace's start")
    fig.tight_layout()
    return fig


# ---- command line ----


def add_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument("--config-dir", default=None, metavar="DIR",
                        help="a model folder that may hold only config.json: random weights (--load-format dummy)")
    parser.set_defaults(device="auto")  # cuda when there is one
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: torch's, one per core); on a CPU shared with other work, "
                             "fewer threads than cores keep a step from waiting for a busy core")
    trace = parser.add_argument_group("trace")
    trace.add_argument("--num-prompts", type=int, default=64)
    trace.add_argument("--request-rate", type=float, default=6.0, help="mean requests per second (Poisson)")
    trace.add_argument("--input-len", type=int, nargs="+", default=[32, 256], metavar="N",
                       help="prompt tokens: N, or LO HI for uniform in [LO, HI]")
    trace.add_argument("--output-len", type=int, nargs="+", default=[16, 128], metavar="N",
                       help="tokens to generate per request: N, or LO HI for uniform in [LO, HI]")
    lab = parser.add_argument_group("policies")
    lab.add_argument("--policies", nargs="+", default=list(POLICY_NAMES), choices=POLICY_NAMES, metavar="NAME",
                     help=f"which to run, in this order ({', '.join(POLICY_NAMES)})")
    lab.add_argument("--batch-size", type=int, default=8, help="requests per batch (static and dynamic)")
    lab.add_argument("--batch-timeout", type=float, default=0.5,
                     help="seconds the oldest waiting request waits before a dynamic batch starts short")
    lab.add_argument("--ttft-slo", type=float, default=1000.0, metavar="MS", help="goodput: TTFT at most this")
    lab.add_argument("--itl-slo", type=float, default=50.0, metavar="MS", help="goodput: mean ITL at most this")
    out = parser.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="PATH", help="write every figure and each request's times")
    out.add_argument("--plot-dir", default=None, metavar="DIR", help="write PNG plots here (needs matplotlib)")
    out.add_argument("--quiet-gc", action=argparse.BooleanOptionalAction, default=True,
                     help="once each engine is built, collect garbage rarely, as the server's engine process "
                          "does (ferry/gc_settings.py); it changes this process's collector for good")


def main_from_args(args: argparse.Namespace) -> int:
    if args.batch_size < 1 or args.batch_timeout < 0:
        raise ValueError("--batch-size must be >= 1 and --batch-timeout >= 0")
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    results = run(args)
    print_results(results, report, args.json)
    if args.plot_dir:
        for path in write_plots(results, Path(args.plot_dir)):
            print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return command_line("policies", __doc__, add_args, main_from_args, argv)


if __name__ == "__main__":
    sys.exit(main())
