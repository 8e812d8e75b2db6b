"""Linear layers that stack several checkpoint projections into one matmul.

Hugging Face checkpoints store q_proj, k_proj and v_proj (and gate_proj, up_proj) as separate
weights, but all of them read the same input, so one matmul over their stacked rows does the same
work with fewer, larger kernels. `MergedLinear` remembers which rows came from which checkpoint
name; the loader uses that to copy each checkpoint tensor straight into its rows.
"""

from __future__ import annotations

import torch
from torch import nn


class MergedLinear(nn.Linear):
    """One nn.Linear whose output rows are the named projections' outputs, in order.

        weight rows:  [ q_proj (q_size) | k_proj (kv_size) | v_proj (kv_size) ]
    """

    def __init__(self, input_size: int, output_sizes: dict[str, int], bias: bool) -> None:
        super().__init__(input_size, sum(output_sizes.values()), bias=bias)
        self.output_sizes = dict(output_sizes)

    def shard_rows(self) -> dict[str, slice]:
        """Checkpoint projection name -> the rows of `weight` (and `bias`) it fills."""
        rows, start = {}, 0
        for name, size in self.output_sizes.items():
            rows[name] = slice(start, start + size)
            start += size
        return rows

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(..., sum(sizes)) -> one (..., size) view per projection."""
        return out.split(list(self.output_sizes.values()), dim=-1)
