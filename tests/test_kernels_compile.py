"""Every Triton kernel compiles for the H100/H200 (sm_90), on a machine without a GPU.

Triton's interpreter, which runs the kernel tests on a CPU, executes a kernel's Python as Python:
it lets through what the compiler refuses (a module-level float read inside a kernel, say), which
would then fail at the first launch on a GPU. `kernel_check --compile` builds each kernel at the
benchmark shapes, its sliding-window and soft-capped variants included, as the JIT would.
"""

from __future__ import annotations

from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def test_every_kernel_compiles_for_sm90_without_spilling():
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton has no ptxas")
    from ferry.bench.kernel_check import compile_report

    lines = compile_report()
    assert len(lines) > 30 and any("window+softcap" in line for line in lines)
    for line in lines:
        assert " regs " in line and "  0 B spilled" in line, line
