"""Server-sent events, read incrementally: bytes in as they arrive, whole events' data out.

An event is a run of lines ended by a blank line; its data is its `data:` lines joined by "\\n".
Lines that begin with ":" are comments (servers send them as keep-alive pings) and other fields
(`event:`, `id:`, `retry:`) carry nothing a completion stream needs. An event is handed out only
once its blank line has arrived, so the time a caller reads it at is the time the whole event was
on the wire.
"""

from __future__ import annotations

import codecs


class SseParser:
    """Feed it the body's bytes in any pieces; it returns the data of each event they complete."""

    def __init__(self) -> None:
        # A multi-byte UTF-8 character may be split across two reads.
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._pending = ""  # text after the last complete line
        self._data: list[str] = []  # data lines of the event being read

    def feed(self, chunk: bytes) -> list[str]:
        # Split on "\n" alone: str.splitlines would also split on characters such as U+2028 that
        # JSON may carry unescaped inside a string.
        *lines, self._pending = (self._pending + self._decoder.decode(chunk)).split("\n")
        events = []
        for line in lines:
            event = self._line(line.removesuffix("\r"))
            if event is not None:
                events.append(event)
        return events

    def finish(self) -> list[str]:
        """At the end of the body: an event whose blank line never came. The standard drops it;
        a server that closes right after `data: [DONE]` means it, so it is kept."""
        events = self.feed(b"\n" if self._pending else b"")
        return events + self.feed(b"\n")

    def _line(self, line: str) -> str | None:
        if not line:  # the blank line that ends an event
            event, self._data = self._data, []
            return "\n".join(event) if event else None
        if line.startswith(":"):
            return None
        field, _, value = line.partition(":")
        if field == "data":
            self._data.append(value.removeprefix(" "))
        return None
