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
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from ferry.bench.server_overhead import _wait_ready
from ferry.bench.throughput import command_line

API_KEY = "dashboard-cost"


def post_completion(url: str, body: dict) -> int:
    """One completion; its output tokens."""
    request = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["usage"]["completion_tokens"]


def run_round(url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> float:
    """Output tokens per second of one round: `concurrency` clients, each sending the next prompt
    as soon as its last completion came back."""
    bodies = [{"prompt": p, "max_tokens": output_len, "ignore_eos": True, "temperature": 0} for p in prompts]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        generated = sum(pool.map(lambda body: post_completion(url, body), bodies))
    return generated / (time.perf_counter() - start)


class Watcher(threading.Thread):
    """Reads the dashboard's event stream as the page does, counting events, until stopped."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.events = self.steps = 0
        self.stopped = threading.Event()

    def run(self) -> None:
        request = urllib.request.Request(self.url + "/dashboard/events",
                                         headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                if line.startswith(b"data: "):
                    self.events += 1
                    self.steps += len(json.loads(line[6:]).get("steps", ()))
                if self.stopped.is_set():
                    return


def bench(args: argparse.Namespace, url: str) -> dict:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(10, 1000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    run_round(url, prompts[:args.concurrency], 8, args.concurrency)  # warm-up
    rounds = []
    for i in range(args.rounds):
        watched = i % 2 == 1
        watcher = Watcher(url) if watched else None
        if watcher is not None:
            watcher.start()
            time.sleep(2.0)  # the engine's first watch measures the hardware once
        tok_s = run_round(url, prompts, args.output_len, args.concurrency)
        events = steps = 0
        if watcher is not None:
            watcher.stopped.set()
            watcher.join(timeout=5)
            events, steps = watcher.events, watcher.steps
        rounds.append({"watched": watched, "output_tok_s": tok_s, "events": events, "steps_seen": steps})
        print(f"round {i + 1}: {'watched  ' if watched else 'unwatched'} {tok_s:10,.1f} output tok/s"
              + (f"  ({events} events, {steps} steps described)" if watched else ""), flush=True)
    off = [r["output_tok_s"] for r in rounds if not r["watched"]]
    on = [r["output_tok_s"] for r in rounds if r["watched"]]
    return {"rounds": rounds, "unwatched_tok_s": statistics.mean(off), "watched_tok_s": statistics.mean(on),
            "ratio": statistics.mean(on) / statistics.mean(off)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> dict:
    if args.rounds < 2 or args.rounds % 2 or min(args.num_prompts, args.concurrency, args.input_len, args.output_len) < 1:
        raise SystemExit("dashboard_cost: --rounds must be even and at least 2, and the sizes at least 1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "ferry", "serve", "--port", str(port), "--api-key", API_KEY, "--no-access-log",
               *args.serve_args]
    log = tempfile.NamedTemporaryFile("w+", prefix="dashboard-cost-server-", suffix=".log", delete=False)
    # Stopped from outside (a time limit's SIGTERM), still show where the server was and stop it.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("dashboard_cost: stopped (SIGTERM)"))
    started = time.perf_counter()
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, server, timeout_s=900)
        print(f"server ready in {time.perf_counter() - started:.0f} s", flush=True)
        result = bench(args, url)
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
