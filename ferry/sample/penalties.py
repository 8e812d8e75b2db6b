"""Logit changes that depend on a request's history: penalties for tokens already seen, and bans.

Both follow vLLM and Hugging Face, in this order:
  repetition (HF/CTRL), over prompt + output:  seen ? (logit > 0 ? logit / r : logit * r) : logit
  frequency and presence (OpenAI), over output:  logit - f * count - p * (count > 0)
  suppression:  logit = -inf for each banned token

They touch only the tokens a row has seen or banned, so they are computed on those (row, token)
pairs alone: the cost grows with the number of tokens in the histories, not with rows x vocab.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from ferry.sample.metadata import SamplingRow
from ferry.transfer import to_device


def needs_adjusting(rows: Sequence[SamplingRow]) -> bool:
    """Whether `apply_penalties_` or `apply_suppression_` would change anything."""
    return any(row.params.uses_penalties or row.suppress_token_ids for row in rows)


def apply_penalties_(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Applies each row's penalties to logits (num_rows, vocab) in place, and returns it."""
    penalized = [i for i, row in enumerate(rows) if row.params.uses_penalties]
    if not penalized:
        return logits
    row_ids, token_ids, counts = _history(rows, penalized, logits.shape[-1], logits.device)  # (U,) each
    repetition, frequency, presence = _per_row(rows, logits.device)  # (num_rows,) each
    r = repetition[row_ids]  # (U,)
    value = logits[row_ids, token_ids]  # (U,)
    value = torch.where(value > 0, value / r, value * r)
    logits[row_ids, token_ids] = value - frequency[row_ids] * counts - presence[row_ids] * (counts > 0)
    return logits


def apply_suppression_(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Sets every row's `suppress_token_ids` to -inf in place, and returns logits."""
    banning = [i for i, row in enumerate(rows) if row.suppress_token_ids]
    if banning:
        row_ids, token_ids = _flatten([rows[i].suppress_token_ids for i in banning], banning, logits.device)
        logits[row_ids, token_ids] = float("-inf")
    return logits


def _history(
    rows: Sequence[SamplingRow], penalized: list[int], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every (row, token) pair of the penalized rows' prompts and outputs, once: (U,) row ids,
    (U,) token ids, and (U,) float32 how often the pair occurs in the output (0: prompt only)."""
    out_rows, out_tokens = _flatten([rows[i].output_token_ids for i in penalized], penalized, device)
    prompt_rows, prompt_tokens = _flatten([rows[i].prompt_token_ids for i in penalized], penalized, device)
    keys = torch.cat([out_rows * vocab + out_tokens, prompt_rows * vocab + prompt_tokens])  # (T,)
    in_output = torch.cat([torch.ones_like(out_tokens), torch.zeros_like(prompt_tokens)])  # (T,)
    seen, inverse = torch.unique(keys, return_inverse=True)  # (U,), (T,)
    counts = torch.zeros(seen.shape, device=device).index_add_(0, inverse, in_output.float())  # (U,)
    return seen // vocab, seen % vocab, counts


def _per_row(rows: Sequence[SamplingRow], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(num_rows,) float32 repetition, frequency and presence penalties (neutral where unused)."""
    values = [
        (row.params.repetition_penalty, row.params.frequency_penalty, row.params.presence_penalty)
        for row in rows
    ]
    return to_device(values, torch.float32, device).unbind(dim=1)


def _flatten(
    sequences: Sequence[Sequence[int]], row_of: Sequence[int], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ragged token lists, sequence j belonging to row row_of[j], as two flat (total,) int64
    tensors: row index and token id."""
    lengths = [len(s) for s in sequences]
    # numpy reads a Python iterable of ints several times faster than torch.tensor does, and the
    # histories of a batch can hold a few hundred thousand tokens.
    flat = np.fromiter(itertools.chain.from_iterable(sequences), dtype=np.int64, count=sum(lengths))
    row_ids = torch.repeat_interleave(torch.tensor(row_of, dtype=torch.int64), torch.tensor(lengths))
    return to_device(row_ids, torch.int64, device), to_device(flat, torch.int64, device)
