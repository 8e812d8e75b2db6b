"""quiet_gc: what is alive is frozen, and collections become rare (in a process of its own)."""

from __future__ import annotations

import subprocess
import sys


def test_quiet_gc_freezes_start_up_objects_and_raises_the_thresholds():
    code = (
        "import gc; from ferry.gc_settings import THRESHOLDS, quiet_gc; "
        "assert gc.get_freeze_count() == 0; quiet_gc(); "
        "assert gc.get_threshold() == THRESHOLDS, gc.get_threshold(); "
        "assert gc.get_freeze_count() > 1000, gc.get_freeze_count(); print('ok')"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
