"""How much CPU the server spends per streamed token, with a stand-in engine that costs nothing.

    python -m ferry.bench.server_overhead [--step-ms 20] [--max-running 256] [--num-prompts 512]
                                          [--input-len 16] [--output-len 128]

The real `ferry serve` app runs with a stand-in engine process that speaks the real channel: it
takes requests, runs up to --max-running of them, and every --step-ms gives each running request
one token (token ids only, no text), as a decode step would. `ferry bench serve` then streams all
requests at once from another process. What it reports:

- the server process's CPU seconds over the run, and per streamed token: the cost of decoding the
  engine's messages, building each SSE chunk, the latency histograms, and writing to the sockets;
- the output throughput the client saw, against the stand-in's own rate (max-running tokens a step).

With a long step the server keeps up, and its CPU per token is the cost of one chunk per token.
With a short one it falls behind, merges each stream's waiting tokens into fewer chunks (async_engine),
and the throughput says how many tokens a second it can stream at all. On a GPU the engine's
steps at large batches take a few milliseconds: if the server cannot stream max-running tokens per
step, HTTP throughput falls short of offline throughput however fast the engine is. Linux only (the
CPU times come from /proc).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
import urllib.request


# ---- the stand-in engine (a spawned process) ----


def stand_in_engine(sock: socket.socket, step_s: float, max_running: int) -> None:
    from ferry.engine.engine_process import Channel
    from ferry.engine.messages import (
        AbortRequest, AddRequest, EngineInfo, EngineReady, EngineStats, Shutdown, StepOutputs,
    )
    from ferry.outputs import CompletionOutput, RequestOutput

    channel = Channel(sock)
    channel.send(EngineReady(EngineInfo(max_model_len=1 << 16, vocab_size=32000, kv_cache_tokens=1 << 30)))
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:
        try:
            while True:
                inbox.put(channel.recv())
        except (EOFError, OSError, ValueError):
            inbox.put(Shutdown())

    threading.Thread(target=read, daemon=True).start()
    waiting: list[tuple[str, int, float]] = []
    running: dict[str, list] = {}  # request id -> [max_tokens, tokens so far, arrival]
    next_step = time.monotonic()
    while True:
        messages = [inbox.get()] if not waiting and not running else []
        while True:
            try:
                messages.append(inbox.get_nowait())
            except queue.Empty:
                break
        for message in messages:
            if isinstance(message, Shutdown):
                return
            if isinstance(message, AddRequest):
                waiting.append((message.request_id, message.params.max_tokens, time.time()))
            elif isinstance(message, AbortRequest):
                running.pop(message.request_id, None)
        while waiting and len(running) < max_running:
            request_id, max_tokens, arrival = waiting.pop(0)
            running[request_id] = [max_tokens, 0, arrival]
        if not running:
            continue
        time.sleep(max(0.0, next_step - time.monotonic()))
        next_step = max(next_step + step_s, time.monotonic())
        outputs = []
        for request_id, state in list(running.items()):
            state[1] += 1
            done = state[1] >= state[0]
            metrics = {"arrival_time": state[2], "first_scheduled_time": state[2]} if done else {}
            completion = CompletionOutput(0, "", [(state[1] * 7) % 32000], finish_reason="length" if done else None)
            outputs.append(RequestOutput(request_id, None, [], [completion], done, metrics=metrics))
            if done:
                del running[request_id]
        channel.send(StepOutputs(outputs, EngineStats(num_running=len(running), num_waiting=len(waiting))))


async def _start_stand_in(step_s: float, max_running: int):
    from ferry.engine.async_engine import AsyncEngine

    return await AsyncEngine.spawn(stand_in_engine, (step_s, max_running), name="ferry-stand-in-engine")


def serve(port: int, step_s: float, max_running: int) -> None:
    import uvicorn

    from ferry.server.app import build_app
    from ferry.server.config import ServerConfig

    app = build_app(ServerConfig(served_model_name="stand-in"), lambda: _start_stand_in(step_s, max_running))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# ---- the measurement ----


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_ready(url: str, server: subprocess.Popen, timeout_s: float = 120.0) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if server.poll() is not None:
            raise SystemExit("the server exited during start-up")
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"the server was not ready in {timeout_s} s")


def _bench_serve(
    url: str, num_prompts: int, input_len: int, output_len: int, result: str, seed: int,
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ferry", "bench", "serve", "--base-url", url, "--prompt-token-ids", "--ignore-eos",
         "--disable-tqdm", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
         "--random-range-ratio", "0", "--request-rate", "inf", "--num-prompts", str(num_prompts),
         "--seed", str(seed), "--save-result", result],
        capture_output=True, text=True,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ferry.bench.server_overhead", description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=20.0, help="the stand-in engine's step time")
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=512)
    parser.add_argument("--input-len", type=int, default=16, help="prompt tokens (sent as token ids)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)  # the server's own process
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.port, args.step_ms / 1000, args.max_running)
        return
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "ferry.bench.server_overhead", "--serve", "--port", str(args.port),
         "--step-ms", str(args.step_ms), "--max-running", str(args.max_running)],
    )
    try:
        _wait_ready(url, server)
        warm = _bench_serve(url, 16, args.input_len, 8, os.devnull, seed=1)  # first requests pay one-time costs
        if warm.returncode != 0:
            raise SystemExit(f"ferry bench serve failed:\n{warm.stderr[-2000:]}")
        result_path = f"/tmp/ferry-server-overhead-{os.getpid()}.json"
        cpu_before, start = cpu_seconds(server.pid), time.monotonic()
        run = _bench_serve(url, args.num_prompts, args.input_len, args.output_len, result_path, seed=0)
        cpu_server, wall = cpu_seconds(server.pid) - cpu_before, time.monotonic() - start
        if run.returncode != 0:
            raise SystemExit(f"ferry bench serve failed:\n{run.stderr[-2000:]}")
        with open(result_path) as f:
            result = json.load(f)
        os.unlink(result_path)
    finally:
        server.terminate()
        server.wait()
    tokens = result["total_output_tokens"]
    ideal = args.max_running / (args.step_ms / 1000)
    print(f"stand-in engine: {args.max_running} running, a token each every {args.step_ms:g} ms "
          f"({ideal:,.0f} tok/s); {args.num_prompts} requests of {args.input_len} prompt and {args.output_len} "
          "output tokens, all at once")
    print(f"  streamed {tokens:,} tokens in {result['duration']:.2f} s: {result['output_throughput']:,.0f} tok/s "
          f"({result['output_throughput'] / ideal:.1%} of the stand-in's rate), mean TPOT "
          f"{result['mean_tpot_ms']:.2f} ms")
    print(f"  server process: {cpu_server:.2f} CPU s over {wall:.2f} s ({cpu_server / wall:.0%} of a core), "
          f"{cpu_server / tokens * 1e6:.1f} us per token")


if __name__ == "__main__":
    main()
