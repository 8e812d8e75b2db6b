"""Speculative sampling: verifying guesses that a draft model *sampled*, so that the tokens kept
follow the target's distribution exactly (Leviathan et al. 2023; Chen et al. 2023).

A row after a guess d, which the draft drew from its distribution q, where the target's is p (both
after the request's temperature, top-k/p, min-p and penalties):

    keep d                         with probability min(1, p(d) / q(d))
    else draw from max(0, p - q)   normalized: the mass that p has beyond q

so a token t comes out with probability min(p(t), q(t)) + (1 - sum min(p, q)) * (p(t) - q(t))+ / Z
= p(t). The row after the last kept guess is drawn from p itself (the bonus token).

Guesses that are just tokens (prompt lookup, a draft's greedy choice) need none of this: q is then a
point mass, keeping d with probability p(d) and otherwise drawing from p without d is exactly
"draw from p, keep d if the draw is d", which is what the sampler does for every row anyway.

Here the rows with sampled guesses get their distribution replaced by what is then drawn from with
the row's uniform number: d alone where it is kept, the normalized residual where not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftRows:
    """Rows of a step's logits that follow a sampled guess, with the guess and its distribution."""

    rows: list[int]  # (m,) indices into the step's rows
    token_ids: torch.Tensor  # (m,) int64 the guesses, on the logits' device
    probs: torch.Tensor  # (m, vocab) float32: q, from which each guess was drawn

    def among(self, subset: list[int]) -> DraftRows:
        """The same rows numbered within `subset` (ascending row indices that hold all of them)."""
        position = {row: i for i, row in enumerate(subset)}
        return DraftRows([position[row] for row in self.rows], self.token_ids, self.probs)


def verify_rows_(probs: torch.Tensor, draft: DraftRows, accept_u: torch.Tensor) -> torch.Tensor:
    """probs: (m, vocab) the target's probabilities in the draft's rows (>= 0, any scale), changed in
    place into what each row must then be sampled from: a point mass on the guess where it is kept
    (accept_u (m, 1) uniform < p(d) / q(d)), else the residual max(0, p - q), or p itself where the
    residual has no mass (p equal to q up to rounding, where the guess is kept anyway but for it)."""
    p = probs / probs.sum(dim=-1, keepdim=True).clamp_min_(torch.finfo(probs.dtype).tiny)
    guess = draft.token_ids.unsqueeze(1)  # (m, 1)
    kept = accept_u * draft.probs.gather(1, guess) < p.gather(1, guess)  # (m, 1)
    residual = (p - draft.probs).clamp_min_(0.0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)
    point = torch.zeros_like(p).scatter_(1, guess, 1.0)
    probs.copy_(torch.where(kept, point, residual))
    return probs
