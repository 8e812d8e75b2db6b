"""The Triton attention backend: store K/V, then one attention kernel for the whole batch.

A step whose requests all bring one token (max_query_len == 1), or all the same few tokens (a decode
and the proposals it verifies, up to MAX_DECODE_QUERY_LEN), runs the decode kernel, which splits
long contexts across the GPU and reads each request's K/V once for all its query tokens. Any other
step, mixed batches included, runs the varlen kernel once
over every request: its decode rows are just requests with query_len 1 (one tile each, the GROUP
query heads of a KV head filling that tile's rows). Splitting a mixed batch into a decode launch
and a prefill launch would need per-step index tensors built and copied to the device, and would
pay off only for long-context decode rows beside a prefill chunk, whose time the chunk dominates.

No host-device synchronization: the launch sizes come from the metadata's host-side values
(max_query_len, max_seq_len, query_start_loc_cpu, seq_lens_cpu), never from device tensors.

Under a CUDA graph every launch is frozen at capture while the contexts grow at each replay, so a
captured backend fixes the decode split count (`decode_num_splits`) and reads from the metadata's
host values only what the graph fixes: the number of requests, and that each brings q tokens.
"""

from __future__ import annotations

import torch

from ferry.attention.backend import AttentionBackend, AttentionMetadata
from ferry.attention.kernels.decode_attention import choose_num_splits, decode_attention
from ferry.attention.kernels.prefill_attention import prefill_attention
from ferry.attention.kernels.store_kv import store_kv

# The most query tokens a request may bring for a step to run the decode kernel: its query tile
# holds all of them times the query heads of one KV head (8 x 8 = 64 rows at most).
MAX_DECODE_QUERY_LEN = 8


class TritonAttentionBackend(AttentionBackend):
    def __init__(self, decode_num_splits: int | None = None) -> None:
        """decode_num_splits: cut every decode context into this many ranges, whatever its length
        (the kernel handles any length with any count: trailing ranges of a short context are empty
        and cost one early return each). None: choose per step from the longest context."""
        self.decode_num_splits = decode_num_splits

    prefill_graph_safe = True  # the varlen kernel's grid: token and request counts alone

    def for_decode_graph(
        self, batch_size: int, num_kv_heads: int, max_model_len: int, device: torch.device
    ) -> TritonAttentionBackend:
        # A graph replays launches with fixed grids: fix the split count chosen for the longest context.
        return TritonAttentionBackend(choose_num_splits(batch_size, num_kv_heads, max_model_len, device))

    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        store_kv(k, v, kv_cache, metadata.slot_mapping, kv_scales)
        q = q if q.stride(-1) == 1 else q.contiguous()
        out = torch.empty_like(q)
        num_real = metadata.query_start_loc_cpu[-1] if metadata.num_reqs else 0
        # Rows past the last request (padding) are attended by no one and stay zero.
        out[num_real:].zero_()
        if num_real == 0:
            return out
        query_len = metadata.max_query_len
        # A window cuts each query token's keys at its own place: only one token a request keeps the
        # decode kernel's split ranges simple, so a windowed verify step runs the varlen kernel.
        decode = query_len == 1 or (query_len <= MAX_DECODE_QUERY_LEN and sliding_window is None)
        if decode and num_real == metadata.num_reqs * query_len:
            # Every request brings query_len tokens, so request i owns rows i*query_len onwards.
            longest = metadata.max_seq_len if sliding_window is None else min(metadata.max_seq_len, sliding_window)
            num_splits = self.decode_num_splits or choose_num_splits(metadata.num_reqs, kv_cache.shape[3], longest, q.device)
            decode_attention(
                q[:num_real], kv_cache, metadata.block_tables, metadata.seq_lens, scale, out[:num_real], num_splits,
                query_len=query_len, kv_scales=kv_scales, sliding_window=sliding_window, softcap=softcap,
            )
        else:
            prefill_attention(
                q, kv_cache, metadata.block_tables, metadata.query_start_loc, metadata.seq_lens,
                num_real, scale, out, kv_scales=kv_scales, sliding_window=sliding_window, softcap=softcap,
            )
        return out
