"""Log-probabilities reported back to the user, taken from the raw model distribution.

Like vLLM's default, they are the log_softmax of the logits as the model produced them, before
penalties, bans, temperature and truncation: they describe the model, not the sampling recipe,
so the chosen token's logprob can be below the top entries even for a greedy request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferry.sample.metadata import SamplingRow


@dataclass
class BatchLogprobs:
    """One entry per row of the batch, None where the row did not ask (params.logprobs is None)."""

    chosen: list[float | None]  # logprob of the chosen token
    ranks: list[int | None]  # of the chosen token: 1 + the number of tokens strictly more likely
    top: list[list[tuple[int, float]] | None]  # params.logprobs most likely (token, logprob), best first


def compute_logprobs(
    raw_logits: torch.Tensor,  # (num_rows, vocab) float32, as the model produced them
    token_ids: torch.Tensor,  # (num_rows,) int64, the chosen tokens
    rows: Sequence[SamplingRow],
) -> BatchLogprobs | None:
    """Computed in one batch over the rows that asked; None when no row did."""
    asked = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    if not asked:
        return None
    index = torch.tensor(asked, device=raw_logits.device)
    wanted = [rows[i].params.logprobs for i in asked]
    chosen, ranks, top = score_tokens(raw_logits[index], token_ids[index], max(wanted))

    out = BatchLogprobs([None] * len(rows), [None] * len(rows), [None] * len(rows))
    for j, (i, n) in enumerate(zip(asked, wanted)):
        out.chosen[i], out.ranks[i], out.top[i] = chosen[j], ranks[j], top[j][:n]
    return out


def score_tokens(
    raw_logits: torch.Tensor,  # (R, vocab), as the model produced them
    token_ids: torch.Tensor,  # (R,) int64: the token to score in each row
    k: int,
) -> tuple[list[float], list[int], list[list[tuple[int, float]]]]:
    """Per row: the token's logprob, its rank (1 + the number of tokens strictly more likely), and
    the k most likely (token, logprob), best first. One device-to-host copy per tensor."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)  # (R, vocab)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # (R, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # (R,)
    top_values, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # (R, k), best first
    top = [list(zip(ids, values)) for ids, values in zip(top_ids.tolist(), top_values.tolist())]
    return chosen.squeeze(1).tolist(), ranks.tolist(), top
