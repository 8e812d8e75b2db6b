"""Tokens per second through the HTTP server against offline `LLM.generate`, for the same requests.

    python -m ferry.bench.serve_vs_offline [--model DIR] [--requests 200] [--prompt-len 64] [--max-tokens 128]

The requests: `--requests` prompts of `--prompt-len` random token ids, each generating exactly
`--max-tokens` tokens (ignore_eos, temperature 0.8). Offline, one `LLM.generate` call runs them all.
Online, a `ferry serve` process gets them all at once as concurrent streaming requests (token-id
prompts, stream_options.include_usage) from this process; every stream must end with
finish_reason "length" and usage.completion_tokens == max_tokens, or the run fails. Both figures
are generated tokens over wall time, warm-up excluded.

Threads: the server's engine runs with `--threads` torch threads (default: all cores but one, as
`ferry serve` does); offline runs once with that many and once with every core (or with the
`--offline-threads` given), and the fastest is the baseline. The client runs on the same machine, so on a small machine it takes CPU
from the server: the ratio is a lower bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

from ferry.engine.engine_process import default_threads


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def make_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Ids from 10 up: the low ids of small vocabularies are special tokens.
    return [[rng.randrange(10, vocab_size) for _ in range(length)] for _ in range(num)]


def run_offline(
    model: str, prompts: list[list[int]], max_tokens: int, engine_args: dict, thread_counts: list[int],
) -> dict[int, tuple[float, int]]:
    """(seconds, tokens) of one LLM.generate over all prompts, for each torch thread count."""
    import torch

    from ferry import LLM, SamplingParams

    llm = LLM(model, **engine_args)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, ignore_eos=True)
    results = {}
    for threads in thread_counts:
        torch.set_num_threads(threads)
        llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        assert tokens == len(prompts) * max_tokens, tokens
        results[threads] = (elapsed, tokens)
    return results


def start_server(model: str, args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "ferry", "serve", "--model", model, "--port", str(port), "--no-access-log",
               "--log-level", "warning", "--max-num-seqs", str(args.max_num_seqs), "--engine-threads", str(args.threads)]
    proc = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise TimeoutError("the server did not start")


async def stream_one(host: str, port: int, prompt: list[int], max_tokens: int) -> int:
    """One streaming request over its own connection; returns its completion tokens after checking
    how it ended. Plain asyncio streams rather than an HTTP client library: with 200 streams on a
    small machine, a general-purpose client would spend more CPU than the server it measures."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "ignore_eos": True,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
    status = await reader.readline()
    assert b" 200 " in status, status
    while await reader.readline() not in (b"\r\n", b""):
        pass  # headers; the body is chunked (a stream has no Content-Length)
    body = bytearray()
    while size := int((await reader.readline()).strip() or b"0", 16):
        body += await reader.readexactly(size + 2)  # the chunk and its CRLF
    writer.close()
    events = bytes(body).replace(b"\r\n", b"").split(b"\n\n")
    *_, final, usage, done, _ = events
    assert done == b"data: [DONE]", events[-3:]
    assert json.loads(final[6:])["choices"][0]["finish_reason"] == "length", final
    return json.loads(usage[6:])["usage"]["completion_tokens"]


async def run_online_async(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    host, port = url.removeprefix("http://").split(":")
    await asyncio.gather(*(stream_one(host, int(port), p, 8) for p in prompts[:4]))  # warm-up
    start = time.perf_counter()
    counts = await asyncio.gather(*(stream_one(host, int(port), p, max_tokens) for p in prompts))
    elapsed = time.perf_counter() - start
    assert all(c == max_tokens for c in counts), f"lost tokens: {sorted(set(counts))}"
    return elapsed, sum(counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--threads", type=int, default=default_threads("cpu"),
                        help="torch threads of the server's engine (default: all cores but one, as `ferry serve`)")
    parser.add_argument("--offline-threads", type=int, nargs="+", default=None,
                        help="torch thread counts to run offline with (default: --threads and every core)")
    args = parser.parse_args()
    if args.model is None:
        from ferry.assets import default_model_path

        args.model = str(default_model_path())
    vocab_size = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(args.requests, args.prompt_len, vocab_size)

    # Offline gets the server's thread count and every core; the better of the two is the baseline.
    thread_counts = sorted(set(args.offline_threads or [args.threads, usable_cores()]))
    offline = run_offline(args.model, prompts, args.max_tokens, {"max_num_seqs": args.max_num_seqs}, thread_counts)
    proc, url = start_server(args.model, args)
    try:
        online_s, online_tokens = asyncio.run(run_online_async(url, prompts, args.max_tokens))
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"{args.requests} requests x {args.max_tokens} tokens (prompt {args.prompt_len} tokens), "
          f"model {args.model}, {usable_cores()} cores")
    for threads, (seconds, tokens) in offline.items():
        print(f"offline LLM.generate, {threads} threads : {tokens} tokens in {seconds:7.2f} s = "
              f"{tokens / seconds:8.1f} tok/s")
    online_rate = online_tokens / online_s
    print(f"HTTP, {args.requests} streams, engine {args.threads} threads : {online_tokens} tokens in "
          f"{online_s:7.2f} s = {online_rate:8.1f} tok/s")
    best = max(tokens / seconds for seconds, tokens in offline.values())
    print(f"ratio HTTP / best offline : {online_rate / best:.1%} (all {args.requests} streams complete)")


if __name__ == "__main__":
    main()
