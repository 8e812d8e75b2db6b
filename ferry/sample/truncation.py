"""Top-k, top-p and min-p: which tokens a sampled row may still choose, as one threshold per row.

Each filter keeps the tokens whose probability is at or above a threshold, so the three reduce
to one number per row and the batch is masked in one pass:

    top-k   the k-th largest probability
    top-p   the probability of the least likely token of the nucleus, the smallest set of most
            likely tokens whose mass reaches p, measured on what top-k kept
    min-p   min_p * the largest probability; a ratio, so renormalizing after top-k or top-p
            does not change what it keeps

Applied in that order (Hugging Face's), a later filter can only raise the bar, so they combine by
max. Tokens tied with a threshold are all kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferry.sample.metadata import RandomRowParams
from ferry.transfer import to_device

# Top-p looks for the nucleus among this many most likely tokens first, and sorts the whole row
# only when the nucleus is larger: a full sort of a 32k-token row costs tens of times more.
NUCLEUS_CANDIDATES = 256


def truncation_threshold(probs: torch.Tensor, params: RandomRowParams) -> torch.Tensor:
    """probs (R, vocab) after temperature -> (R, 1): each row's smallest probability that
    survives top-k, top-p and min-p; 0 for rows that use none."""
    threshold = probs.new_zeros((probs.shape[0], 1))
    if params.top_k_rows:
        index, some = _rows(probs, params.top_k_rows)
        threshold[index] = _kth_largest(some, params.top_k[index], params.max_top_k)
    if params.top_p_rows:
        index, some = _rows(probs, params.top_p_rows)
        floor = threshold[index]
        threshold[index] = torch.maximum(floor, _nucleus_threshold(some, floor, params.top_p[index]))
    if params.min_p_rows:
        index, some = _rows(probs, params.min_p_rows)
        min_p_floor = some.amax(dim=-1, keepdim=True) * params.min_p[index].unsqueeze(1)  # (M, 1)
        threshold[index] = torch.maximum(threshold[index], min_p_floor)
    return threshold


def _kth_largest(probs: torch.Tensor, k: torch.Tensor, max_k: int) -> torch.Tensor:
    """probs (S, vocab), k (S,) in [1, max_k] -> (S, 1) each row's k-th largest probability."""
    top = probs.topk(max_k, dim=-1).values  # (S, max_k), largest first
    return top.gather(1, k.unsqueeze(1) - 1)


def _nucleus_threshold(probs: torch.Tensor, floor: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """probs (S, vocab), floor (S, 1) the top-k threshold, p (S,) -> (S, 1) the top-p threshold.

    A token is in the nucleus when the mass of the tokens more likely than it is still below p;
    the most likely token always is.
    """
    kept = torch.where(probs >= floor, probs, 0.0)  # (S, vocab): what top-k left
    wanted_mass = p.unsqueeze(1) * kept.sum(dim=-1, keepdim=True)  # (S, 1)
    threshold, found = _nucleus_among(kept, wanted_mass, NUCLEUS_CANDIDATES)
    if not bool(found.all()):
        rest = (~found).nonzero().squeeze(1)
        threshold[rest] = _nucleus_among(kept[rest], wanted_mass[rest], kept.shape[-1])[0]
    return threshold


def _nucleus_among(
    kept: torch.Tensor, wanted_mass: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Looks for the nucleus among the num_candidates most likely tokens. Returns its threshold
    (S, 1), and (S,) whether it was found: not where every candidate is in the nucleus and more
    tokens of non-zero probability may follow."""
    values = kept.topk(min(num_candidates, kept.shape[-1]), dim=-1).values  # (S, C), largest first
    mass_above = F.pad(values.cumsum(dim=-1)[:, :-1], (1, 0))  # (S, C): mass of the tokens before
    in_nucleus = mass_above < wanted_mass  # (S, C): a prefix of each row
    # The most likely token is in every nucleus, also where p * mass rounds to 0 (a top_p of 1e-300).
    last = (in_nucleus.sum(dim=-1, keepdim=True) - 1).clamp_(min=0)  # (S, 1)
    found = ~in_nucleus[:, -1] | (values[:, -1] == 0) | (values.shape[-1] == kept.shape[-1])
    return values.gather(1, last), found


def _rows(probs: torch.Tensor, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The index tensor of rows, and probs[rows] (no copy when that is every row)."""
    index = to_device(rows, torch.int64, probs.device)
    return index, probs if len(rows) == probs.shape[0] else probs[index]
