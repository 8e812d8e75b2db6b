"""Traces on disk: finished requests' traces in a rolling series of Chrome trace files.

    DIR/ferry-trace-<started>-<pid>-0001.json    requests 1 .. R
    DIR/ferry-trace-<started>-<pid>-0002.json    requests R+1 .. 2R     <- being filled

Every file is, at every moment, a whole trace that Perfetto opens: `flush` writes the file being
filled to a temporary name and renames it over the old one. Requests are encoded once, as they are
added; a flush only joins bytes, so flushing often costs little. When a file holds R requests the
next one starts, and only the newest `max_files` files stay: a writer never holds more than
max_files * R requests on disk. Files of earlier runs are left alone. The engine's steps
(`add_step`) go into the file being filled, beside the requests they served.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path

from ferry.metrics.chrome_trace import process_name_event, step_event, steps_track_event, trace_events
from ferry.metrics.tracing import RequestTrace, StepTrace


class TraceWriter:
    def __init__(self, directory: Path, requests_per_file: int = 1000, max_files: int = 10) -> None:
        if requests_per_file < 1 or max_files < 1:
            raise ValueError("requests_per_file and max_files must be >= 1")
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.requests_per_file = requests_per_file
        self.max_files = max_files
        self._prefix = f"ferry-trace-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        self._index = 1
        self._fragments: list[bytes] = []  # the current file's requests and steps, encoded
        self._num_requests = 0  # in the current file
        self._unwritten = False
        self._written: deque[Path] = deque()  # oldest first

    @property
    def files(self) -> list[Path]:
        """The files this writer has written and kept, oldest first."""
        return list(self._written)

    def add(self, trace: RequestTrace) -> None:
        """Take a finished request's trace. It reaches the disk at the next flush, or at once when it
        fills the current file."""
        self._fragments.append(json.dumps(trace_events(trace), separators=(",", ":")).encode()[1:-1])
        self._unwritten = True
        self._num_requests += 1
        if self._num_requests >= self.requests_per_file:
            self.flush()
            self._index += 1
            self._fragments = []
            self._num_requests = 0

    def add_step(self, step: StepTrace) -> None:
        """Take an engine step (its span on the steps' track of the file being filled)."""
        self._fragments.append(json.dumps(step_event(step), separators=(",", ":")).encode())
        self._unwritten = True

    def flush(self) -> None:
        """Write the current file, if something was added since it was last written."""
        if not self._unwritten:
            return
        path = self.directory / f"{self._prefix}-{self._index:04d}.json"
        head = [json.dumps(e, separators=(",", ":")).encode() for e in (process_name_event(), steps_track_event())]
        body = b",".join([*head, *self._fragments])
        temporary = path.with_suffix(".tmp")
        temporary.write_bytes(b'{"displayTimeUnit":"ms","traceEvents":[' + body + b"]}")
        os.replace(temporary, path)
        self._unwritten = False
        if not self._written or self._written[-1] != path:
            self._written.append(path)
            while len(self._written) > self.max_files:
                self._written.popleft().unlink(missing_ok=True)
