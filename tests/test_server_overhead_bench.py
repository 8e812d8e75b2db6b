"""`python -m ferry.bench.server_overhead`: the real server with a stand-in engine streams every token."""

from __future__ import annotations

import re
import socket
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")


def test_every_token_is_streamed_and_the_server_cpu_is_reported():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run(
        [sys.executable, "-m", "ferry.bench.server_overhead", "--num-prompts", "64", "--output-len", "25",
         "--max-running", "16", "--step-ms", "1", "--port", str(port)],
        capture_output=True, text=True, timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # 64 requests of 25 tokens, 16 at a time: all 1,600 tokens arrive, whatever the batching; enough
    # of them that the server's CPU time is more than a clock tick (10 ms).
    assert "streamed 1,600 tokens" in run.stdout
    per_token = float(re.search(r"([\d.]+) us per token", run.stdout).group(1))
    assert per_token > 0
