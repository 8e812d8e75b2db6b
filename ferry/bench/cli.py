"""`ferry bench BENCHMARK ...`: the benchmarks' command line.

Each benchmark is one entry of BENCH_COMMANDS: its options (defined here, with the standard library
only, so that `ferry --help` stays fast and works without the benchmarks' HTTP client) and the
module whose `main_from_args(args) -> int` runs it, imported only when that benchmark runs. A new
benchmark is one more entry.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass

from ferry.bench.datasets import WORKLOADS


@dataclass(frozen=True)
class BenchCommand:
    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    module: str  # has main_from_args(args: argparse.Namespace) -> int


def add_target_args(parser: argparse.ArgumentParser, timeout_s: float, url_help: str = "the server's root URL"):
    """The server a load benchmark talks to (serve, soak); returns the group for more options."""
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help=url_help)
    target.add_argument("--endpoint", default="/v1/completions", help="/v1/completions or /v1/chat/completions")
    target.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    target.add_argument("--timeout", type=float, default=timeout_s, help="seconds one request may take in all")
    return target


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    target = add_target_args(parser, 600.0)
    target.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="ask for exactly max_tokens tokens (vLLM's ignore_eos)")
    target.add_argument("--extra-body", default=None, help="JSON object merged into every request, e.g. "
                        "'{\"temperature\": 0}'")

    data = parser.add_argument_group("workload")
    data.add_argument("--dataset-name", default="random", choices=list(WORKLOADS))
    data.add_argument("--num-prompts", type=int, default=1000, help="requests in all (turns, for multi-turn)")
    data.add_argument("--random-input-len", type=int, default=1024,
                      help="prompt tokens (shared-prefix: after the prefix; multi-turn: per user turn)")
    data.add_argument("--random-output-len", type=int, default=128, help="tokens to generate per request")
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths uniform in [len * (1 - r), len * (1 + r)]; 0: fixed")
    data.add_argument("--prompt-token-ids", action="store_true",
                      help="send prompts as token id lists (/v1/completions only)")
    data.add_argument("--shared-prefix-groups", type=int, default=4, help="distinct prefixes (shared-prefix)")
    data.add_argument("--shared-prefix-len", type=int, default=512, help="tokens of each prefix (shared-prefix)")
    data.add_argument("--multi-turn-turns", type=int, default=4, help="turns per conversation (multi-turn)")
    data.add_argument("--tokenizer", default=None,
                      help="folder with the tokenizer.json to build prompts and count tokens with "
                           "(default: the bundled model's)")
    data.add_argument("--seed", type=int, default=0)

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="mean requests per second (conversations per second, for multi-turn); inf: all at once")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrival gaps: 1 Poisson, <1 burstier, >1 more regular")
    load.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    load.add_argument("--request-rate-sweep", default=None,
                      help="comma-separated rates to run one after another, e.g. 1,2,4,inf (replaces --request-rate)")
    load.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent before each run")

    out = parser.add_argument_group("output")
    out.add_argument("--metric-percentiles", default="90,99",
                     help="comma-separated percentiles to report besides mean, median and std")
    out.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                     help="SLOs for goodput, NAME one of ttft, tpot, e2el, e.g. --goodput ttft:500 tpot:50")
    out.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    out.add_argument("--save-result", default=None, metavar="PATH",
                     help="write the summary and every request's figures as JSON")
    out.add_argument("--plot-dir", default=None, metavar="DIR", help="write PNG plots here (needs matplotlib)")


def add_soak_args(parser: argparse.ArgumentParser) -> None:
    target = add_target_args(parser, 300.0, "the server's root URL (loopback only)")
    target.add_argument("--server-pid", type=int, default=None,
                        help="sample the RSS of this process and its descendants (the `ferry serve` process)")

    data = parser.add_argument_group("workload")
    data.add_argument("--random-input-len", type=int, default=64, help="prompt tokens")
    data.add_argument("--random-output-len", type=int, default=32, help="tokens to generate (ignore_eos)")
    data.add_argument("--num-prompts", type=int, default=1000, help="distinct prompts, sent in turn")
    data.add_argument("--tokenizer", default=None,
                      help="folder with the tokenizer.json to build prompts with (default: the bundled model's)")
    data.add_argument("--seed", type=int, default=0)

    load = parser.add_argument_group("load")
    load.add_argument("--capacity", type=float, default=None, metavar="REQ_PER_S",
                      help="the server's capacity for this workload (default: measure it first)")
    load.add_argument("--capacity-duration", type=float, default=60.0, help="seconds of the capacity phase")
    load.add_argument("--capacity-concurrency", type=int, default=256,
                      help="requests in flight in the capacity phase's closed loop (default: the engine's default "
                           "max_num_seqs, so that the capacity is the saturated one)")
    load.add_argument("--overload", type=float, default=2.5, help="Poisson arrivals at this times the capacity")
    load.add_argument("--duration", type=float, default=1800.0, help="seconds of overload")
    load.add_argument("--cancel-fraction", type=float, default=0.1,
                      help="fraction of requests the client gives up after a random delay")
    load.add_argument("--cancel-delay-max", type=float, default=10.0,
                      help="a cancelled request is given up uniformly within this many seconds of being sent")
    load.add_argument("--stream-fraction", type=float, default=0.5, help="fraction of requests streamed")
    load.add_argument("--max-outstanding", type=int, default=1000,
                      help="most requests in flight; arrivals past it are dropped client-side and counted")
    load.add_argument("--max-requests", type=int, default=200_000, help="most requests the overload sends")

    check = parser.add_argument_group("checks")
    check.add_argument("--rss-interval", type=float, default=5.0, help="seconds between RSS samples")
    check.add_argument("--warmup-fraction", type=float, default=0.1,
                       help="the first part of the overload that the RSS trend leaves out")
    check.add_argument("--max-rss-slope", type=float, default=10.0,
                       help="MiB per 10 minutes of RSS growth after warm-up that still counts as flat")
    check.add_argument("--gauge-timeout", type=float, default=60.0,
                       help="seconds to wait, after the load, for the engine's gauges to reach 0")

    out = parser.add_argument_group("output")
    out.add_argument("--result-file", default=None, metavar="PATH",
                     help="write every figure, the RSS samples and each request's outcome as JSON")


def _module_args(module: str) -> Callable[[argparse.ArgumentParser], None]:
    """The options of an engine benchmark, defined in its own module (which imports torch lazily)."""
    return lambda parser: importlib.import_module(module).add_args(parser)


BENCH_COMMANDS: tuple[BenchCommand, ...] = (
    BenchCommand("serve", "load an OpenAI-compatible server and report TTFT, TPOT, ITL, latency and throughput",
                 add_serve_args, "ferry.bench.serve"),
    BenchCommand("throughput", "offline throughput of the engine next to the roofline bound of the same work",
                 _module_args("ferry.bench.throughput"), "ferry.bench.throughput"),
    BenchCommand("latency", "batch-1 TTFT and per-token decode latency next to their roofline bounds",
                 _module_args("ferry.bench.latency"), "ferry.bench.latency"),
    BenchCommand("soak", "overload a ferry server for a long time: one outcome per request, RSS, gauges, "
                 "Retry-After truth", add_soak_args, "ferry.bench.soak"),
    BenchCommand("policies", "one arrival trace served by static, dynamic and continuous batching, compared",
                 _module_args("ferry.bench.policies"), "ferry.bench.policies"),
)


def add_bench_command(subparsers) -> argparse._SubParsersAction:
    """Register `bench` on the top-level parser's subcommands; returns the benchmarks' own
    subcommands, to which more can be added."""
    bench = subparsers.add_parser("bench", help="measure ferry, or any OpenAI-compatible server")
    benchmarks = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for command in BENCH_COMMANDS:
        parser = benchmarks.add_parser(command.name, help=command.help, description=command.help)
        command.add_args(parser)
        parser.set_defaults(func=_runner(command.module), command_parser=parser)
    return benchmarks


def _runner(module: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(module).main_from_args(args)

    return run
