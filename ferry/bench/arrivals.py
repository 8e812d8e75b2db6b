"""When requests arrive: Poisson or bursty (gamma) arrivals at a mean rate, as vLLM defines them.

The gaps between arrivals are drawn from a gamma distribution of shape k = burstiness and scale
1 / (rate * k), so the mean gap is 1 / rate whatever k is, and the squared coefficient of
variation (variance / mean^2) is 1 / k:

    k = 1      exponential gaps: a Poisson process
    k < 1      more variable: bursts of requests separated by lulls
    k > 1      more regular; k = inf is a fixed gap of 1 / rate
    rate = inf every request at time 0

Unlike vLLM, the gaps are not rescaled to make the last arrival land exactly at n / rate: the
arrivals stay a true sample of the process, and the benchmark reports the rate it achieved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ArrivalProcess:
    request_rate: float  # mean requests per second; inf sends everything at once
    burstiness: float = 1.0  # gamma shape; 1 is Poisson

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"the request rate must be positive, not {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"the burstiness must be positive, not {self.burstiness}")

    @property
    def name(self) -> str:
        if math.isinf(self.request_rate):
            return "all at once"
        if math.isinf(self.burstiness):
            return "fixed intervals"
        return "Poisson process" if self.burstiness == 1 else f"gamma arrivals (burstiness {self.burstiness:g})"

    def intervals(self, n: int, seed: int) -> np.ndarray:
        """The n gaps, in seconds, each before its request (the first one before the first)."""
        if math.isinf(self.request_rate):
            return np.zeros(n)
        if math.isinf(self.burstiness):
            return np.full(n, 1.0 / self.request_rate)
        rng = np.random.default_rng(seed)
        return rng.gamma(shape=self.burstiness, scale=1.0 / (self.request_rate * self.burstiness), size=n)

    def offsets(self, n: int, seed: int) -> np.ndarray:
        """The n arrival times, in seconds after the start."""
        return np.cumsum(self.intervals(n, seed))
