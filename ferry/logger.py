"""Logging. Modules log through `logging.getLogger(__name__)`, under the "ferry" logger, which this
module gives a handler on stderr at INFO (start-up facts: load time, KV cache size, the GEMV choices,
graph capture). FERRY_LOGGING_LEVEL sets another level (a name or a number); FERRY_CONFIGURE_LOGGING=0,
set before ferry is imported, leaves the "ferry" logger to the application: no handler, and its
records propagate to the application's handlers as usual."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s %(name)s: %(message)s"


def configure_logging() -> None:
    """Give the "ferry" logger its handler, once per process."""
    if os.environ.get("FERRY_CONFIGURE_LOGGING", "1") == "0":
        return
    root = logging.getLogger("ferry")
    if any(getattr(handler, "_ferry", False) for handler in root.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
    handler._ferry = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(_level(os.environ.get("FERRY_LOGGING_LEVEL", "INFO")))
    root.propagate = False  # the application's root handlers would print each line twice


def _level(name: str) -> int:
    """A level by name (DEBUG, INFO, ...) or number; INFO for anything else."""
    if name.strip().isdigit():
        return int(name)
    level = logging.getLevelName(name.strip().upper())
    return level if isinstance(level, int) else logging.INFO
