"""Fewer garbage collections in ferry's own long-running processes.

Python's cyclic collector runs a generation-0 pass every 700 container allocations, and every so
often a full pass over every tracked object alive. A server streaming tokens allocates a handful of
short-lived objects per token (the decoded output, the chunk, the bytes), none of them in cycles,
so at thousands of tokens a second the collector runs constantly and rescans everything start-up
left behind: the modules, the model's Python objects, the tokenizer. With a stand-in engine
(`python -m ferry.bench.server_overhead`), that was a sixth of the server's CPU per token.

`quiet_gc` freezes what is alive at the end of start-up (it is never scanned again) and raises the
thresholds, so collections are rare and short. Reference counting still frees everything at once;
only garbage in cycles waits longer. The server and the engine process call it when they are ready;
an application that uses `LLM` in its own process can call it too.
"""

from __future__ import annotations

import gc

THRESHOLDS = (50_000, 20, 100)  # allocations before a generation-0 pass; passes before older ones


def quiet_gc() -> None:
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
