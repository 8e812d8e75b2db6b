"""A request's latencies, measured where its outputs reach the server: what its client feels, less
the network.

    arrival ──── TTFT ────┤first token├─ ITL ─┤tok├─ ITL ─┤tok├ ... ┤last token│
    └──────────────────────────── E2E ──────────────────────────────────────────┘
    and, from the engine's own clock: queue time = engine arrival -> first scheduled

One `RequestClock` follows one engine request (one prompt, with its n completions):

- TTFT: arrival to the first token of any of its completions; one value per request.
- ITL: per completion, the gap between one delta of its tokens and the next, as they reach the
  server. A delta is usually one step's token; it holds more when one step makes several, or when
  the server fell behind and merged what waited. Either way the client gets it as one chunk, so
  the gaps are the ones a benchmark client measures between chunks (vLLM's ITL), and vLLM's own
  server counts one per engine iteration too. The histogram's sum is the time after first tokens;
  TPOT is that over the tokens after the first.
- E2E: arrival to the output that finishes the request (all n completions); one per request.
  A request the client abandons has no E2E.
- Queue time: the engine's `first_scheduled_time - arrival_time`, carried in the final output's
  `metrics`, because only the engine sees its queue.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferry.outputs import RequestOutput


@dataclass(frozen=True)
class Latencies:
    """What one output of a request adds to the latency histograms, in seconds."""

    time_to_first_token: float | None = None
    inter_token_latencies: tuple[float, ...] = ()
    e2e_latency: float | None = None
    queue_time: float | None = None


class RequestClock:
    def __init__(self, arrival: float) -> None:
        self.arrival = arrival  # time.monotonic() when the server took the request
        self.first_token_time: float | None = None
        self._last_tokens_at: dict[int, float] = {}  # completion index -> when its last tokens came

    def update(self, output: RequestOutput, now: float) -> Latencies:
        """Account for a delta output that arrived at `now`."""
        ttft = None
        gaps: list[float] = []
        for completion in output.outputs:
            if not completion.token_ids:
                continue
            last = self._last_tokens_at.get(completion.index)
            self._last_tokens_at[completion.index] = now
            if last is not None:
                gaps.append(now - last)
            elif self.first_token_time is None:
                self.first_token_time = now
                ttft = now - self.arrival
        if not output.finished:
            return Latencies(ttft, tuple(gaps))
        return Latencies(ttft, tuple(gaps), now - self.arrival, _queue_time(output.metrics))


def _queue_time(metrics: dict[str, float]) -> float | None:
    if "first_scheduled_time" not in metrics or "arrival_time" not in metrics:
        return None
    return max(0.0, metrics["first_scheduled_time"] - metrics["arrival_time"])
