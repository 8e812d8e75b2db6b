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
    logprobs = torch.log_softmax(raw_logits[index], dim=-1)  # (A, vocab)
    chosen = logprobs.gather(1, token_ids[index].unsqueeze(1))  # (A, 1)
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # (A,)
    wanted = [rows[i].params.logprobs for i in asked]
    most = min(max(wanted), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(most, dim=-1)  # (A, most), best first

    out = BatchLogprobs([None] * len(rows), [None] * len(rows), [None] * len(rows))
    # One device-to-host copy per tensor, then plain Python.
    chosen_host, ranks_host = chosen.squeeze(1).tolist(), ranks.tolist()
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for j, (i, n) in enumerate(zip(asked, wanted)):
        out.chosen[i], out.ranks[i] = chosen_host[j], ranks_host[j]
        out.top[i] = list(zip(top_ids[j][:n], top_values[j][:n]))
    return out
