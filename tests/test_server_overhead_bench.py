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
        [sys.executable, "-m", "ferry.bench.server_overhead", "--num-prompts", "6", "--output-len", "5",
         "--max-running", "4", "--step-ms", "2", "--port", str(port)],
        capture_output=True, text=True, timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # 6 requests of 5 tokens, 4 at a time: all 30 tokens arrive, whatever the batching.
    assert "streamed 30 tokens" in run.stdout
    per_token = float(re.search(r"([\d.]+) us per token", run.stdout).group(1))
    assert per_token > 0
