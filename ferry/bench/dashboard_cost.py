"""What a browser on /dashboard costs the engine: the same load served with and without a watcher.

    python -m ferry.bench.dashboard_cost [--rounds 6] [--num-prompts 64] [--concurrency 32]
        [--input-len 128] [--output-len 128] [-- SERVE ARGS: --model DIR --load-format dummy ...]

One `ferry serve` (the bundled model unless serve arguments follow `--`) runs a fixed load of
--num-prompts completions (token-id prompts, EOS ignored, --concurrency at a time) per round.
Rounds alternate: without a watcher, then with one reading /dashboard/events as the page does (the
engine then samples itself: dashboard/watch.py; the server streams the samples), and so on, so that
a drift of the machine's speed falls on both sides alike. Reported: output tokens per second of
each round, the mean of each side, and the watched rounds' throughput against the unwatched
rounds'. The watcher reads from this process: the browser's own drawing happens on its machine,
not the server's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from ferry.bench.server_overhead import _wait_ready
from ferry.bench.throughput import command_line

API_KEY = "dashboard-cost"


async def run_round(session, url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> float:
    """Output tokens per second of one round."""
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    generated = 0

    async def client():
        nonlocal generated
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0}
            async with session.post(url + "/v1/completions", json=body) as response:
                reply = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"the server answered {response.status}: {reply}")
                generated += reply["usage"]["completion_tokens"]

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return generated / (time.perf_counter() - start)


async def watch(session, url: str, stop: asyncio.Event, seen: list[int]) -> None:
    """Read the dashboard's event stream as the page does, until `stop`; counts the events."""
    async with session.get(url + "/dashboard/events") as response:
        async for line in response.content:
            if line.startswith(b"data: "):
                event = json.loads(line[6:])
                seen.append(len(event.get("steps", ())))
            if stop.is_set():
                return


async def bench(args: argparse.Namespace, url: str) -> dict:
    import aiohttp

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 1000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        await run_round(session, url, prompts[:args.concurrency], 8, args.concurrency)  # warm-up
        rounds = []
        for i in range(args.rounds):
            watched = i % 2 == 1
            stop, seen = asyncio.Event(), []
            watcher = asyncio.create_task(watch(session, url, stop, seen)) if watched else None
            if watched:
                await asyncio.sleep(2.0)  # the engine's first watch measures the hardware once
            tok_s = await run_round(session, url, prompts, args.output_len, args.concurrency)
            if watcher is not None:
                stop.set()
                await asyncio.wait_for(watcher, timeout=5)
            rounds.append({"watched": watched, "output_tok_s": tok_s, "events": len(seen), "steps_seen": sum(seen)})
            print(f"round {i + 1}: {'watched  ' if watched else 'unwatched'} {tok_s:10,.1f} output tok/s"
                  + (f"  ({len(seen)} events, {sum(seen)} steps described)" if watched else ""), flush=True)
    off = [r["output_tok_s"] for r in rounds if not r["watched"]]
    on = [r["output_tok_s"] for r in rounds if r["watched"]]
    return {"rounds": rounds, "unwatched_tok_s": statistics.mean(off), "watched_tok_s": statistics.mean(on),
            "ratio": statistics.mean(on) / statistics.mean(off)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "ferry", "serve", "--port", str(port), "--api-key", API_KEY, "--no-access-log",
               *args.serve_args]
    log = tempfile.NamedTemporaryFile("w+", prefix="dashboard-cost-server-", suffix=".log", delete=False)
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, server, timeout_s=900)
        result = asyncio.run(bench(args, url))
    except BaseException:
        log.flush()
        print(f"the server's log ({log.name}) ends:\n" + "".join(open(log.name).readlines()[-30:]), file=sys.stderr)
        raise
    finally:
        server.terminate()
        server.wait(30)
    print(f"unwatched {result['unwatched_tok_s']:,.1f} tok/s, watched {result['watched_tok_s']:,.1f} tok/s: "
          f"watched / unwatched = {result['ratio']:.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "args": {k: v for k, v in vars(args).items() if k != "func"}}, f, indent=2)
    return result


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=6, help="alternating unwatched and watched rounds (even)")
    parser.add_argument("--num-prompts", type=int, default=64, help="completions per round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH")
    parser.add_argument("serve_args", nargs="*", help="after --: arguments of ferry serve (the model and engine)")


def main(argv: list[str] | None = None) -> int:
    return command_line("dashboard_cost", __doc__, add_args, lambda args: run(args) and 0, argv)


if __name__ == "__main__":
    sys.exit(main())
