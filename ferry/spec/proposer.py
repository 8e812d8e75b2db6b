"""The proposer seam: what an executor asks of whatever guesses a request's next tokens.

Decode reads every weight to produce one token per request. A step that brings a request's last
token and k proposed tokens after it reads the same weights once and samples after each of the
k + 1 positions; the proposals that match what was sampled are kept (core/outputs.py), so a good
guesser yields several tokens a step for about the price of one. What guesses is behind this
seam: prompt lookup (n-grams of the request's own tokens), a small draft model, or, in tests, an
oracle that knows the answer.

The executor calls `propose` once a step's tokens are on the host, for the requests that sampled in
it; the scheduler hands each request's proposals to the next step, cut to what the token budget,
max_tokens and the context length leave room for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    # At most this many tokens per request and step (decode graphs are captured for 1 + this).
    num_speculative_tokens: int

    def propose(
        self,
        request_ids: list[str],
        prompt_token_ids: list[Sequence[int]],
        output_token_ids: list[Sequence[int]],
    ) -> list[list[int]]:
        """Up to num_speculative_tokens next tokens for each request (an empty list: no guess)."""
