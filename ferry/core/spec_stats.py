"""How speculative proposals fare: counted where verified steps come back, named as vLLM's metrics.

    num_drafts            verify rows (one request's proposals checked in one step)
    num_draft_tokens      proposed tokens checked
    num_accepted_tokens   of which kept
    accepted_per_pos[j]   rows that kept their (j+1)-th proposal: acceptance by position

Acceptance rate = accepted / draft tokens; mean accepted length = 1 + accepted / drafts (tokens a
verify row yields, the bonus token included).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_draft_tokens:
            self.accepted_per_pos += [0] * (num_draft_tokens - len(self.accepted_per_pos))
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1

    def __add__(self, other: SpecDecodingStats) -> SpecDecodingStats:
        """The counts of both."""
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        mine, theirs = (c.accepted_per_pos + [0] * (n - len(c.accepted_per_pos)) for c in (self, other))
        return SpecDecodingStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                                 self.num_accepted_tokens + other.num_accepted_tokens,
                                 [a + b for a, b in zip(mine, theirs)])

    def since(self, before: SpecDecodingStats) -> SpecDecodingStats:
        """What was counted after `before` (an earlier copy of these counts)."""
        earlier = before.accepted_per_pos + [0] * (len(self.accepted_per_pos) - len(before.accepted_per_pos))
        return SpecDecodingStats(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                                 self.num_accepted_tokens - before.num_accepted_tokens,
                                 [now - then for now, then in zip(self.accepted_per_pos, earlier)])

    @property
    def acceptance_by_position(self) -> list[float]:
        """The share of verify rows that kept their (j+1)-th proposal, for each j."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_pos]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify row yields: its kept proposals and the token sampled after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
