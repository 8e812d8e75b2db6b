"""Every Triton kernel compiles for the H100/H200 (sm_90), on a machine without a GPU.

Triton's interpreter, which runs the kernel tests on a CPU, executes a kernel's Python as Python:
it lets through what the compiler refuses (a module-level float read inside a kernel, say), which
would then fail at the first launch on a GPU. `kernel_check --compile` builds each kernel at the
benchmark shapes, its sliding-window and soft-capped variants included, as the JIT would. It runs
in a process of its own: under the interpreter (TRITON_INTERPRET, which the kernel tests set) a
kernel cannot be compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def test_every_kernel_compiles_for_sm90_without_spilling():
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "ferry.bench.kernel_check", "--compile"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [line for line in run.stdout.splitlines() if " regs " in line]
    assert len(lines) > 30 and any("window+softcap" in line for line in lines), run.stdout
    for line in lines:
        assert "  0 B spilled" in line, line
