"""Logit changes that depend on a request's parameters and history: biases, penalties for tokens
already seen, and bans.

They follow vLLM and Hugging Face, in this order:
  logit bias (OpenAI):  logit + bias[token]
  repetition (HF/CTRL), over prompt + output:  seen ? (logit > 0 ? logit / r : logit * r) : logit
  frequency and presence (OpenAI), over output:  logit - f * count - p * (count > 0)
  bans:  logit = -inf for each token the row may not choose this step: the engine's suppressed tokens
         (min_tokens), every token outside allowed_token_ids, and the last token of each bad word
         whose other tokens end the output (vLLM's rule: a word is banned as it would be completed)

Bias, penalties and bans by id touch only the tokens a row has seen, biased or banned, so they are
computed on those (row, token) pairs alone: the cost grows with the number of tokens named, not with
rows x vocab. allowed_token_ids masks its rows whole.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch

from ferry.sample.metadata import SamplingRow
from ferry.transfer import to_device


def needs_adjusting(rows: Sequence[SamplingRow]) -> bool:
    """Whether `apply_logit_bias_`, `apply_penalties_` or `apply_bans_` would change anything."""
    return any(row.params.adjusts_logits or row.suppress_token_ids for row in rows)


def apply_logit_bias_(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Adds each row's logit_bias to logits (num_rows, vocab) in place, and returns it."""
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    if biased:
        biases = [rows[i].params.logit_bias for i in biased]
        row_ids, token_ids = _flatten([list(b) for b in biases], biased, logits.device)  # (B,) each
        values = to_device([v for b in biases for v in b.values()], torch.float32, logits.device)  # (B,)
        logits[row_ids, token_ids] += values  # a row's keys are distinct: no pair repeats
    return logits


def apply_penalties_(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Applies each row's penalties to logits (num_rows, vocab) in place, and returns it."""
    penalized = [i for i, row in enumerate(rows) if row.params.penalizes_repeats]
    if not penalized:
        return logits
    row_ids, token_ids, counts = _history(rows, penalized, logits.shape[-1], logits.device)  # (U,) each
    repetition, frequency, presence = _per_row(rows, logits.device)  # (num_rows,) each
    r = repetition[row_ids]  # (U,)
    value = logits[row_ids, token_ids]  # (U,)
    value = torch.where(value > 0, value / r, value * r)
    logits[row_ids, token_ids] = value - frequency[row_ids] * counts - presence[row_ids] * (counts > 0)
    return logits


def apply_bans_(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Sets every token that a row may not choose this step to -inf in place, and returns logits."""
    allowing = [i for i, row in enumerate(rows) if row.params.allowed_token_ids]
    if allowing:
        index = to_device(allowing, torch.int64, logits.device)
        local_rows, token_ids = _flatten([rows[i].params.allowed_token_ids for i in allowing],
                                         range(len(allowing)), logits.device)
        allowed = torch.zeros((len(allowing), logits.shape[-1]), dtype=torch.bool, device=logits.device)  # (A, vocab)
        allowed[local_rows, token_ids] = True
        logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
    banned = [(i, ids) for i, row in enumerate(rows) if (ids := _banned(row))]
    if banned:
        row_ids, token_ids = _flatten([ids for _, ids in banned], [i for i, _ in banned], logits.device)
        logits[row_ids, token_ids] = float("-inf")
    return logits


def _banned(row: SamplingRow) -> Sequence[int]:
    """The tokens banned by id this step: the engine's suppressed ones, and the bad words' last tokens."""
    words = row.params.bad_words_token_ids
    if not words:
        return row.suppress_token_ids
    return [*row.suppress_token_ids, *bad_word_bans(words, row.output_token_ids)]


def bad_word_bans(words: Sequence[Sequence[int]], output: Sequence[int | None]) -> list[int]:
    """The last token of each bad word whose other tokens are the last ones of the output (all of a
    one-token word's): choosing it would complete the word.

        word [a, b, c], output [..., a, b]  ->  c banned
    """
    bans = []
    for word in words:
        prefix_len = len(word) - 1
        if prefix_len == 0 or (prefix_len <= len(output) and list(output[-prefix_len:]) == list(word[:-1])):
            bans.append(word[-1])
    return bans


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
