"""What the sampler is told about each row, and the per-row parameters gathered into tensors.

The sampler works on whole batches: here each request's `SamplingParams` becomes one entry of a
per-row tensor, so temperature, top-k, top-p and min-p each cost one tensor op for the batch
instead of one op per request. The lists of row indices say which rows need which step, so a
step nobody asked for costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferry.sampling_params import SamplingParams
from ferry.transfer import to_device

# Below this temperature a row is sampled greedily: dividing by a near-zero temperature overflows
# the logits to inf and the softmax to NaN, and the distribution is an argmax anyway (vLLM's line).
GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingRow:
    """One request's sampling needs for this step: one row of the logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # A seeded request's own generator (see `request_generator`), owned by the caller and on the
    # logits' device: this row's random draw comes from it and nothing else does. None: the
    # row draws from the sampler's shared generator.
    generator: torch.Generator | None = None
    # Tokens that must not be chosen this step (the engine bans EOS and stop tokens before
    # min_tokens is reached).
    suppress_token_ids: Sequence[int] = ()

    @property
    def greedy(self) -> bool:
        return self.params.temperature < GREEDY_TEMPERATURE


def request_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator a seeded request keeps for its whole life; every random draw of that request,
    and only of that request, comes from it, so its tokens do not depend on its batch mates. Any
    integer is a seed: it is taken modulo 2**64 (what torch does with a negative one anyway)."""
    return torch.Generator(device=device).manual_seed(seed % 2**64)


def position_seed(seed: int, position: int, stream: int = 0) -> int:
    """The seed of a seeded request's draw for the token at `position` of its output: its random
    stream is a function of (seed, position) alone, so it samples the same tokens whatever shares
    its batch, however often it was preempted and recomputed, and whether its tokens came one or
    several a step. `stream` tells apart draws of other purposes (a draft model's guesses)."""
    return (seed * 0x9E3779B97F4A7C15 + position + stream * 0xD1B54A32D192ED03) & (2**63 - 1)


@dataclass(frozen=True)
class RandomRowParams:
    """The sampled (non-greedy) rows' parameters, one entry per row, on the logits' device, and
    which rows use each truncation (host lists, so that no step needs to ask the device)."""

    temperature: torch.Tensor  # (R,) float32
    top_k: torch.Tensor  # (R,) int64 in [1, vocab]; vocab where top-k is off
    top_p: torch.Tensor  # (R,) float32 in (0, 1]
    min_p: torch.Tensor  # (R,) float32 in [0, 1]
    top_k_rows: list[int]  # rows with top_k < vocab
    top_p_rows: list[int]  # rows with top_p < 1
    min_p_rows: list[int]  # rows with min_p > 0
    max_top_k: int  # the largest top_k of the top-k rows; 0 when there are none

    @classmethod
    def from_rows(
        cls, rows: Sequence[SamplingRow], vocab_size: int, device: torch.device
    ) -> RandomRowParams:
        params = [row.params for row in rows]
        top_k = [min(p.top_k, vocab_size) if p.top_k > 0 else vocab_size for p in params]
        top_k_rows = [i for i, k in enumerate(top_k) if k < vocab_size]
        return cls(
            temperature=_floats([p.temperature for p in params], device),
            top_k=to_device(top_k, torch.int64, device),
            top_p=_floats([p.top_p for p in params], device),
            min_p=_floats([p.min_p for p in params], device),
            top_k_rows=top_k_rows,
            top_p_rows=[i for i, p in enumerate(params) if p.top_p < 1],
            min_p_rows=[i for i, p in enumerate(params) if p.min_p > 0],
            max_top_k=max((top_k[i] for i in top_k_rows), default=0),
        )

    @property
    def truncates(self) -> bool:
        return bool(self.top_k_rows or self.top_p_rows or self.min_p_rows)


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device)
