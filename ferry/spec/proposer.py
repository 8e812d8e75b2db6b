"""The proposer seam: what an executor asks of whatever guesses a request's next tokens.

Decode reads every weight to produce one token per request. A step that brings a request's last
token and k proposed tokens after it reads the same weights once and samples after each of the
k + 1 positions; the proposals that the verification keeps (core/outputs.py) are tokens gained, so
a good guesser yields several tokens a step for about the price of one. What guesses is behind this
seam: prompt lookup (ngram.py: n-grams of the request's own tokens), a small draft model
(draft_model.py), or, in tests and benchmarks, an oracle that knows the answer (replay.py).

The runner keeps one `SpecRequest` per running request, beside its own state, and calls `propose`
once a step's tokens are on the host, for the requests that sampled in it; the scheduler hands each
request's proposals to the next step, cut to what the token budget, max_tokens and the context
length leave room for.

How proposals are verified (sample/rejection.py): a guess that is just a token (prompt lookup, a
draft's greedy choice) is kept when the target samples that very token after it; a guess the draft
*sampled*, from its distribution q (`SpecRequest.draft_probs`), is kept with probability
min(1, p/q) and otherwise replaced by a sample of the residual max(0, p - q). Either way every
output token follows the target's distribution p exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ferry.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from ferry.attention.backend import AttentionBackend
    from ferry.config import CacheConfig, EngineConfig


@dataclass(eq=False)
class SpecRequest:
    """One running request as a proposer sees it. The lists are the runner's own (they grow as the
    request does); `memo` is the proposer's record of the request, dropped with it (preempted or
    finished), so a proposer keeps no table of requests that could outlive them."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # every token known: proposals are asked for after a collected step
    block_ids: list[int]  # the request's KV blocks (a draft model keeps its own KV in the same blocks)
    # Tokens of the request whose K/V the target had cached when the runner first saw it (a prefix
    # cache hit, or none): a draft model's cache holds those positions too (draft_model.py says why).
    num_cached_tokens: int = 0
    memo: Any = None
    # The distribution each of the last proposals was sampled from, (len(proposal), vocab) float32 on
    # the device; None when the proposals are plain guesses (the rejection rule then is "keep the
    # guess if the target samples it").
    draft_probs: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """The request's tokens start .. end - 1 (prompt, then output)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]


class Proposer:
    """What guesses next tokens. Subclasses set num_speculative_tokens and implement `propose`."""

    # At most this many tokens per request and step (decode graphs are captured for 1 + this).
    num_speculative_tokens: int
    # KV slots past a request's verified tokens that `propose` writes (a draft model stores the K/V
    # of its guesses as it makes them); the scheduler allocates them with the step.
    lookahead_slots: int = 0
    # A draft model's own KV caches, laid out as the target's and indexed by the same blocks: the
    # runner copies their blocks with the target's (copy-on-write of a cached partial block).
    kv_caches: Sequence[torch.Tensor] = ()

    def propose(
        self, requests: list[SpecRequest], prefilled: Sequence[tuple[SpecRequest, int]] = (),
    ) -> list[list[int]]:
        """Up to num_speculative_tokens next tokens for each request (an empty list: no guess). A
        proposer that samples its guesses sets each request's `draft_probs`. `prefilled`: requests
        whose prompt the step computed up to (excluding) the given position without sampling (a
        draft model computes the same, so that its cache keeps level with the target's)."""
        raise NotImplementedError

    def kv_bytes_per_block(self, cache: CacheConfig) -> int:
        """Bytes its own KV cache takes per block of the target's (a draft model's); 0: none."""
        return 0

    def allocate(self, config: EngineConfig, num_blocks: int, backend: AttentionBackend) -> None:
        """Take its share of the device once the KV cache is sized: a draft model allocates its cache
        of num_blocks blocks and captures its graphs."""

