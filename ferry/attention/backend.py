"""The attention backend interface: what a model's attention layer asks of a kernel.

One forward step runs a flat batch of tokens from many requests. Some requests bring a prefill chunk
(many tokens), others a single decode token; the backend sees no difference. Request i owns query
rows `query_start_loc[i] : query_start_loc[i+1]` and, after this step, has `seq_lens[i]` tokens of
context in the KV cache, so its query tokens sit at the last positions of that context:

    context of request i:  [ 0 1 2 ... seq_len-query_len-1 | seq_len-query_len ... seq_len-1 ]
                             already cached (earlier steps)  | this step's query tokens
    query token j attends to context positions 0 .. seq_len-query_len+j  (causal)

A layer with a sliding window W (Mistral) sees only the last W of those: positions
p - W + 1 .. p for the query at position p, as transformers masks them.

The KV cache of one layer is one tensor (2, num_blocks, block_size, num_kv_heads, head_dim): K and V
cut into fixed-size blocks, in the model's dtype or in float8 e4m3 (torch_ref.py says how FP8
values are scaled: the layer's `kv_scales`, one K and one V scale per KV head). Token t of request i lives in block `block_tables[i][t // block_size]` at
offset `t % block_size`; its flat slot is `block * block_size + offset`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the paged KV cache, and what each request attends to."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64: flat KV slot for each new token
    query_start_loc: torch.Tensor  # (num_reqs + 1,) int32: cumulative query lengths
    seq_lens: torch.Tensor  # (num_reqs,) int32: context length including this step's tokens
    block_tables: torch.Tensor  # (num_reqs, max_blocks_per_req) int32; unused entries are 0
    max_query_len: int
    max_seq_len: int
    # Host copies of query_start_loc and seq_lens, for backends that loop in Python.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(ABC):
    """Stores a step's new K/V into the paged cache, then computes causal attention over it.

    Contract: `forward` must write k and v at `metadata.slot_mapping` before attending, because a
    query token attends to its own key. Padding rows (slot -1) must be neither stored nor attended.
    An FP8 cache comes with its layer's kv_scales; a 16-bit one ignores them.
    """

    # Whether a step with prefill chunks can be replayed from a CUDA graph (executor/prefill_graphs.py):
    # its launches must depend on nothing but the token and request counts, not on host values.
    prefill_graph_safe = False

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # (num_tokens, num_heads, head_dim)
        k: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        v: torch.Tensor,  # (num_tokens, num_kv_heads, head_dim)
        kv_cache: torch.Tensor,  # (2, num_blocks, block_size, num_kv_heads, head_dim)
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # (num_kv_heads,) float32 each: K's, V's
        sliding_window: int | None = None,  # a query sees only the last this many keys, itself included
        softcap: float | None = None,  # scores become softcap * tanh(score / softcap) before the softmax (Gemma 2)
    ) -> torch.Tensor:  # (num_tokens, num_heads, head_dim)
        ...

    def for_decode_graph(
        self, batch_size: int, num_kv_heads: int, max_model_len: int, device: torch.device
    ) -> AttentionBackend | None:
        """The backend to capture a CUDA graph of a padded decode batch of `batch_size` rows with,
        for any context up to max_model_len; None when this backend cannot be captured (it reads
        per-request host values at run time)."""
        return None


@dataclass
class ForwardContext:
    """Everything a model forward needs besides token ids and positions; passed explicitly down to
    every attention layer (no hidden global). Layer `i` uses `kv_caches[i]`."""

    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]
    backend: AttentionBackend
