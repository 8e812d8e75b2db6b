"""One step's batch as the model takes it: every scheduled token flattened into one row of tensors,
with the attention metadata that says which request each token belongs to. The runner builds it
(model_runner.py), and so do the decode graphs, into their captured buffers (cuda_graph.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ferry.attention.backend import AttentionMetadata


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_tokens,)
    attn_metadata: AttentionMetadata
    # Rows of the hidden states whose logits are needed: the last token of every request that
    # samples, then every token of chunks that asked for prompt logprobs. A padded decode batch
    # (cuda_graph.py) needs its first n rows, a slice: a view, no gather.
    logits_indices: torch.Tensor | slice
    sample_rows: list[int]  # index into scheduled of each request that samples
    prompt_logprob_rows: list[tuple[int, int, int]]  # (scheduled index, first logits row, count)


def fill_block_table(table: np.ndarray, tables: list[list[int]], lengths: np.ndarray) -> None:
    """Write row i's first lengths[i] entries from tables[i], in one vectorized assignment; the rest
    of `table` (num_reqs, width) is left as it is."""
    width = table.shape[1]
    table[np.arange(width) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), table.dtype, int(lengths.sum())
    )
