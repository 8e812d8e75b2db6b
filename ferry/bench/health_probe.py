"""How long /health takes while the server chews on heavy requests: is the event loop ever blocked?

    python -m ferry.bench.health_probe --base-url http://127.0.0.1:8000 --load big-prompt

Polls GET /health every `--interval` seconds from one connection while `--load` runs alongside:

    big-prompt     one completion whose prompt is --prompt-mb MB of text
    many-prompts   one completion with 100 prompts of --prompt-mb / 100 MB each
    chat           chat requests, --concurrency at a time, for --duration seconds (point the server
                   at a model whose chat template is slow or hostile to see what rendering costs)

and reports the probe's latency percentiles while the load was in flight, with how each heavy
request ended (a prompt too long for the model is a 400, after the server has read the body). The
server must be on this machine (loopback).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass
class ProbeResult:
    latencies_s: list[float] = field(default_factory=list)  # /health while the load ran
    statuses: dict[int, int] = field(default_factory=dict)  # the load's responses, by status
    load_s: float = 0.0

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] if ordered else float("nan")

    def summary(self) -> dict:
        return {
            "probes": len(self.latencies_s), "load_s": round(self.load_s, 3), "load_statuses": self.statuses,
            "p50_ms": round(1e3 * self.percentile(50), 2), "p99_ms": round(1e3 * self.percentile(99), 2),
            "max_ms": round(1e3 * max(self.latencies_s, default=float("nan")), 2),
            "mean_ms": round(1e3 * statistics.fmean(self.latencies_s), 2) if self.latencies_s else None,
        }


def _loads(args: argparse.Namespace) -> list[tuple[str, dict]]:
    size = int(args.prompt_mb * 1e6)
    if args.load == "big-prompt":
        return [("/v1/completions", {"prompt": "All work and no play. " * (size // 22), "max_tokens": 1})]
    if args.load == "many-prompts":
        part = "All work and no play. " * (size // 100 // 22)
        return [("/v1/completions", {"prompt": [part] * 100, "max_tokens": 1})]
    messages = [{"role": "user", "content": "What does str.split do?"}]
    return [("/v1/chat/completions", {"messages": messages, "max_tokens": 1})]


async def run(args: argparse.Namespace) -> ProbeResult:
    result = ProbeResult()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(args.base_url, headers=headers, timeout=timeout) as session:
        done = asyncio.Event()

        async def probe() -> None:
            while not done.is_set():
                start = time.perf_counter()
                async with session.get("/health") as response:
                    await response.read()
                result.latencies_s.append(time.perf_counter() - start)
                await asyncio.sleep(args.interval)

        async def send(path: str, payload: bytes) -> None:
            async with session.post(path, data=payload, headers={"Content-Type": "application/json"}) as response:
                await response.read()
                result.statuses[response.status] = result.statuses.get(response.status, 0) + 1

        # Encoded before the clock starts: the client's own JSON work would stall its probes.
        loads = [(path, json.dumps(body).encode()) for path, body in _loads(args)]

        async def load() -> None:
            started = time.perf_counter()
            if args.load == "chat":
                deadline = started + args.duration

                async def worker() -> None:
                    while time.perf_counter() < deadline:
                        await send(*loads[0])

                await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            else:
                for _ in range(args.repeat):
                    await asyncio.gather(*(send(path, payload) for path, payload in loads))
            result.load_s = time.perf_counter() - started
            done.set()

        await asyncio.sleep(0)
        await asyncio.gather(probe(), load())
    return result


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--load", choices=["big-prompt", "many-prompts", "chat"], default="big-prompt")
    parser.add_argument("--prompt-mb", type=float, default=20.0, help="MB of prompt text (big-prompt, many-prompts)")
    parser.add_argument("--repeat", type=int, default=3, help="times to send the heavy request (one after another)")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of chat load")
    parser.add_argument("--concurrency", type=int, default=4, help="chat requests in flight")
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between two /health probes")
    parser.add_argument("--timeout", type=float, default=600.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ferry.bench.health_probe", description=__doc__.split("\n")[0])
    add_args(parser)
    args = parser.parse_args(argv)
    summary = asyncio.run(run(args)).summary()
    print(json.dumps({"load": args.load, **summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
