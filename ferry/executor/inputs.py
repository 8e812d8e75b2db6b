"""One step's batch as the model takes it: every scheduled token flattened into one row of tensors,
with the attention metadata that says which request each token belongs to. The runner builds it
(model_runner.py), and so do the decode and prefill graphs, into their captured buffers
(cuda_graph.py, prefill_graphs.py).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from ferry.attention.backend import AttentionMetadata
from ferry.transfer import to_device


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
    padded: bool = False  # in the prefill graphs' buffers, padded to a captured token count (prefill_graphs.py)


def fill_block_table(table: np.ndarray, tables: list[list[int]], lengths: np.ndarray) -> None:
    """Write row i's first lengths[i] entries from tables[i], in one vectorized assignment; the rest
    of `table` (num_reqs, width) is left as it is."""
    width = table.shape[1]
    table[np.arange(width) < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(tables), table.dtype, int(lengths.sum())
    )


def flat_batch(
    query_lens: np.ndarray, starts: np.ndarray, tables: list[list[int]], block_size: int, device: torch.device,
) -> tuple[torch.Tensor, AttentionMetadata, np.ndarray]:
    """The positions and attention metadata of a flat batch in which request i brings query_lens[i]
    tokens from position starts[i] on, its KV blocks in tables[i]; and the query start locations
    (num_reqs + 1,) on the host. (The token ids are the caller's: they may already be on the device.)"""
    num_reqs = len(query_lens)
    query_start_loc = np.zeros(num_reqs + 1, np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    seq_lens = starts + query_lens
    # Per token: which request it belongs to and its position in that request.
    req_of_token = np.repeat(np.arange(num_reqs), query_lens)  # (num_tokens,)
    positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - starts, query_lens)
    lengths = np.fromiter(map(len, tables), np.int64, num_reqs)
    block_table = np.zeros((num_reqs, int(lengths.max())), np.int64)  # rows padded with 0 (never read)
    fill_block_table(block_table, tables, lengths)
    slot_mapping = block_table[req_of_token, positions // block_size] * block_size + positions % block_size
    metadata = AttentionMetadata(
        slot_mapping=to_device(slot_mapping, torch.int64, device),
        query_start_loc=to_device(query_start_loc, torch.int32, device),
        seq_lens=to_device(seq_lens, torch.int32, device),
        block_tables=to_device(block_table, torch.int32, device),
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc.tolist(),
        seq_lens_cpu=seq_lens.tolist(),
    )
    return to_device(positions, torch.int64, device), metadata, query_start_loc

