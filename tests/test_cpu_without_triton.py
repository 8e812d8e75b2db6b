"""On a machine without Triton (CPU installs of torch do not bring it), ferry never imports it."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import sys
sys.modules["triton"] = None  # any import of triton now fails
from ferry import LLM, SamplingParams
for async_scheduling in (False, True):
    llm = LLM(dtype="float32", async_scheduling=async_scheduling, enforce_eager=False)
    params = [SamplingParams(max_tokens=6), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1, max_tokens=6),
              SamplingParams(temperature=0.8, repetition_penalty=1.2, min_tokens=3, seed=2, max_tokens=6)]
    outs = llm.generate(["def f(x):", "import os", "class A:"], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
print("ok")
"""


def test_cpu_engine_runs_without_triton():
    result = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
