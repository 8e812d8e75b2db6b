"""The sampler: one step's logits for every request that needs a token -> one token per request.

Per row, in vLLM / Hugging Face order:

    raw logits ─► logit bias ─► penalties ─► bans (-inf) ─┬─► greedy rows: argmax
                                                          └─► others: / temperature ─► softmax
                                                              ─► top-k ─► top-p ─► min-p (truncation.py)
                                                              ─► inverse CDF at one uniform number
    raw logits ─► log_softmax ─► logprobs, ranks, top logprobs (rows that ask)

Every step is one tensor op over the rows that need it; Python loops only over rows to gather
their parameters and over seeded rows to draw their random number.

Each sampled row consumes exactly one uniform number, so a seeded request draws it from its own
generator and gets the same tokens whatever its batch mates. One number per row, rather than an
exponential race (argmax p / q with q ~ Exp(1) per token), because drawing a (rows, vocab) noise
tensor costs more on a CPU than all the rest of the step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferry.sample.logprobs import compute_logprobs
from ferry.sample.metadata import RandomRowParams, SamplingRow
from ferry.sample.penalties import apply_bans_, apply_logit_bias_, apply_penalties_, needs_adjusting
from ferry.sample.rejection import DraftRows, verify_rows_
from ferry.sample.truncation import truncation_threshold
from ferry.structured.bitmask import masked_logits
from ferry.transfer import to_device


@dataclass
class SamplerOutput:
    """Host lists, one entry per row, in the order of the rows."""

    token_ids: list[int]
    # Under the raw model distribution (see logprobs.py). The lists are None when no row asked
    # for logprobs; otherwise their entries are None for the rows that did not.
    logprobs: list[float | None] | None  # logprob of the chosen token
    top_logprobs: list[list[tuple[int, float]] | None]  # params.logprobs most likely (token, logprob)
    ranks: list[int | None] | None  # rank of the chosen token, 1 = most likely


class Sampler:
    """Chooses one token per row. Unseeded rows share one generator, seeded from `seed`, so a whole
    run is reproducible given the same batches; seeded rows bring their own (`SamplingRow.generator`).
    """

    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], token_bitmask: torch.Tensor | None = None,
        draft: DraftRows | None = None,
    ) -> SamplerOutput:
        """logits: (num_rows, vocab) on the generator's device, row i belongs to rows[i]; the
        tensor is not modified. token_bitmask: the tokens each row may choose (structured output,
        structured/bitmask.py), on the logits' device. draft: rows that verify a sampled guess
        (rejection.py)."""
        logits = logits.float()  # no copy when already float32
        token_ids = self.choose(logits, rows, token_bitmask, draft)  # (num_rows,) int64
        reported = compute_logprobs(logits, token_ids, rows)
        if reported is None:
            return SamplerOutput(token_ids.tolist(), None, [None] * len(rows), None)
        return SamplerOutput(token_ids.tolist(), reported.chosen, reported.top, reported.ranks)

    def choose(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], token_bitmask: torch.Tensor | None = None,
        draft: DraftRows | None = None,
    ) -> torch.Tensor:
        """(num_rows, vocab) -> (num_rows,) int64 token ids, left on the logits' device: the step
        that does not need them on the host yet (asynchronous scheduling) reads them later. A
        token_bitmask bans, like the bans, every token whose bit is 0. `draft`: the rows that verify
        a guess sampled from a known distribution (sampled rows only), kept or replaced by the
        rejection rule (rejection.py)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"expected logits of shape ({len(rows)}, vocab), got {tuple(logits.shape)}")
        logits = self._adjusted(logits, rows, token_bitmask)
        sampled = [i for i, row in enumerate(rows) if not row.greedy]
        if not sampled:
            return logits.argmax(dim=-1)
        if len(sampled) == len(rows):
            return self._sample(logits, list(rows), draft)
        token_ids = logits.argmax(dim=-1)  # right for the greedy rows; the others are replaced
        index = to_device(sampled, torch.int64, logits.device)
        token_ids[index] = self._sample(logits[index], [rows[i] for i in sampled],
                                        draft.among(sampled) if draft is not None else None)
        return token_ids

    def distribution(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """(R, vocab) -> (R, vocab) float32: the probabilities each row's token is drawn from (after
        the logit bias, penalties, bans, temperature and truncation), normalized. For sampled rows
        (a draft model's guesses are drawn from these, then verified with them)."""
        probs = self._probs(self._adjusted(logits, rows), list(rows))
        return probs / probs.sum(dim=-1, keepdim=True).clamp_min_(torch.finfo(probs.dtype).tiny)

    def _adjusted(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], token_bitmask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The logits in float32, with the bitmask's, the bias's, the penalties' and the bans' changes
        (a new tensor where there are any)."""
        _check_generators(rows)
        logits = logits.float()
        if token_bitmask is not None:
            logits = masked_logits(logits, token_bitmask)
        if needs_adjusting(rows):
            # A penalty at the edge of float64 (a repetition_penalty that is 0 or inf in float32)
            # can make a logit inf or NaN; `finite` keeps the order of the rest.
            adjusted = apply_penalties_(apply_logit_bias_(logits.clone(), rows), rows)
            logits = apply_bans_(finite_(adjusted), rows)
        return logits

    def _probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """(R, vocab) after temperature and truncation; not normalized (truncation zeroes entries)."""
        params = RandomRowParams.from_rows(rows, logits.shape[-1], logits.device)
        probs = finite_(logits / params.temperature.unsqueeze(1)).softmax(dim=-1)  # (R, vocab)
        if params.truncates:
            probs.masked_fill_(probs < truncation_threshold(probs, params), 0.0)
        return probs

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], draft: DraftRows | None = None) -> torch.Tensor:
        """logits: (R, vocab), not modified -> (R,) int64 token ids."""
        probs = self._probs(logits, rows)
        u = self.uniforms(rows, logits.device)
        if draft is not None:
            # Each verifying row draws a second number, for the keep-or-replace test.
            accept_u = self.uniforms([rows[i] for i in draft.rows], logits.device)
            index = to_device(draft.rows, torch.int64, logits.device)
            probs[index] = verify_rows_(probs[index], draft, accept_u)
        return inverse_cdf(probs, u, logits)

    def uniforms(self, rows: list[SamplingRow], device: torch.device) -> torch.Tensor:
        """(R, 1) uniform numbers in [0, 1): rows with a generator draw from it, the rest from ours."""
        u = torch.empty((len(rows), 1), device=device)
        shared = [i for i, row in enumerate(rows) if row.generator is None]
        if shared:
            draws = torch.rand((len(shared), 1), generator=self.generator, device=device)
            u[to_device(shared, torch.int64, device)] = draws
        own = [i for i, row in enumerate(rows) if row.generator is not None]
        if own:
            draws = [torch.rand(1, generator=rows[i].generator, device=device) for i in own]
            u[to_device(own, torch.int64, device)] = torch.stack(draws)
        return u


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
    """probs (R, vocab) >= 0, not necessarily normalized; u (R, 1) in [0, 1) -> (R,) token ids,
    always in [0, vocab).

    Token j owns the interval [cdf[j-1], cdf[j]) of [0, total): a token of zero probability owns
    an empty one, so it is never chosen, even where u is 0. A row with no mass to sample from (every
    token banned, or NaN from the model) takes the argmax of its `logits` (token 0 without them):
    one bad row must not hand the next step an id outside the embedding.
    """
    cdf = probs.cumsum(dim=-1)  # (R, vocab), non-decreasing
    # u <= 1 - 2**-24 (torch.rand's float32 grid), so u * total rounds to below total and some
    # cdf entry exceeds it.
    total = cdf[:, -1:]  # (R, 1)
    token_ids = torch.searchsorted(cdf, u * total, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)
    fallback = logits.argmax(dim=-1) if logits is not None else torch.zeros_like(token_ids)
    return torch.where((total > 0).squeeze(1), token_ids, fallback)  # NaN > 0 is False


def finite_(logits: torch.Tensor) -> torch.Tensor:
    """logits with NaN as -inf (never chosen) and +inf as the largest float (chosen first), in place:
    the softmax of a row holding +inf or NaN is NaN everywhere."""
    return torch.nan_to_num_(logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf"))


def _check_generators(rows: Sequence[SamplingRow]) -> None:
    for row in rows:
        if row.params.seed is not None and row.generator is None and not row.greedy:
            raise ValueError("a seeded request must bring its own generator (see request_generator)")
