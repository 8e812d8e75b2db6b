"""kill -9 of the engine process under load: how fast do its requests fail, and the server recover?

    ferry serve --port 8000 &
    python -m ferry.bench.engine_kill --base-url http://127.0.0.1:8000 --server-pid $!

Sends --requests requests (half streamed) that each generate --max-tokens tokens, waits until they
are all in the engine, kills the engine process (the server's child) with SIGKILL, and reports when
each request ended and with what, then how long until a new request succeeds (the server starts a
new engine process by itself). The server must be on this machine (loopback).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import aiohttp


def engine_pid(server_pid: int) -> int:
    """The server's child that runs the engine (multiprocessing's spawn), not its resource tracker."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    engines = [int(pid) for pid in children if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    if len(engines) != 1:
        raise RuntimeError(f"expected one engine process among {children}")
    return engines[0]


async def _waiting(session: aiohttp.ClientSession) -> float:
    async with session.get("/metrics") as response:
        text = await response.text()
    values = [line.split()[-1] for line in text.splitlines()
              if line.startswith(("ferry:num_requests_waiting ", "ferry:num_requests_running "))]
    return sum(float(v) for v in values)


async def run(args: argparse.Namespace) -> dict:
    body = {"prompt": "Once upon a time", "max_tokens": args.max_tokens, "ignore_eos": True}
    ended: list[tuple[float, str]] = []
    async with aiohttp.ClientSession(args.base_url, timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def one(stream: bool) -> None:
            async with session.post("/v1/completions", json={**body, "stream": stream}) as response:
                raw = await response.read()
            outcome = f"HTTP {response.status}"
            if stream and response.status == 200:
                events = [line[6:] for line in raw.decode().split("\n") if line.startswith("data: {")]  # (not at U+2028)
                last = json.loads(events[-1]) if events else {}
                outcome = f"stream error {last['error']['code']}" if "error" in last else "stream ok"
            elif response.status != 200:
                outcome += f" {json.loads(raw)['error']['code']}"
            ended.append((time.monotonic(), outcome))

        tasks = [asyncio.create_task(one(i % 2 == 0)) for i in range(args.requests)]
        while await _waiting(session) < args.requests:
            await asyncio.sleep(0.01)
        killed = time.monotonic()
        os.kill(engine_pid(args.server_pid), signal.SIGKILL)
        await asyncio.gather(*tasks)
        while True:
            async with session.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4}) as response:
                if response.status == 200:
                    break
            await asyncio.sleep(0.05)
        recovered = time.monotonic()
    outcomes: dict[str, int] = {}
    for _, outcome in ended:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return {"requests": args.requests, "outcomes": outcomes,
            "last_error_after_kill_s": round(max(t for t, _ in ended) - killed, 3),
            "first_success_after_kill_s": round(recovered - killed, 2)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ferry.bench.engine_kill", description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--server-pid", type=int, required=True, help="the `ferry serve` process")
    parser.add_argument("--requests", type=int, default=20, help="requests in flight when the engine is killed")
    parser.add_argument("--max-tokens", type=int, default=2000, help="tokens each asks for (ignore_eos)")
    args = parser.parse_args(argv)
    print(json.dumps(asyncio.run(run(args))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
