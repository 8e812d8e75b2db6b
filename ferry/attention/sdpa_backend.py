"""Paged attention through torch's scaled_dot_product_attention: the backend where Triton does not
run (a CPU). The arithmetic is the reference's (torch_ref.py); what differs is where the host's work
goes.

On a CPU a small model's step is bound by the host's work per op, not by its bytes: each of a
layer's few dozen ops costs microseconds whether it moves a hundred bytes or a megabyte. So what
does not change from layer to layer is worked out once per step, on the first layer's call (a
`_Plan`, kept while the layers are handed the same metadata object, which a step does not change
once its forward has begun): the slots to store at, and each request's rows, blocks and
causal mask. A layer is then the store of K and V, and for each request one gather of its blocks
and one attention call. A step whose requests all bring one token (a decode step) attends in one
call for the whole batch: every request's blocks gathered side by side, the keys past a request's
context masked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferry.attention.backend import AttentionBackend, AttentionMetadata
from ferry.attention.kv_cache import written_halves
from ferry.attention.torch_ref import TorchReferenceBackend, is_fp8, to_cache, visible_mask


@dataclass
class _Plan:
    slots: torch.Tensor  # (num_stored,) int64: the flat slot of each stored token
    stored: torch.Tensor | None  # rows of the step's tokens that are stored; None: all of them
    # A decode step: (num_reqs * max_blocks,) int64 block ids of every request side by side, the
    # context length they span, and the mask of the keys each request sees (None for one request).
    decode_blocks: torch.Tensor | None
    decode_len: int
    decode_mask: torch.Tensor | None
    # Otherwise, per request: (first row, last row + 1, its blocks, context length, causal mask or None).
    requests: list[tuple[int, int, torch.Tensor, int, torch.Tensor | None]]


class SdpaAttentionBackend(AttentionBackend):
    def __init__(self) -> None:
        self._planned: tuple[AttentionMetadata, int | None, _Plan] | None = None

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
        plan = self._plan(metadata, kv_cache.shape[2], q.device, sliding_window)
        if softcap is not None:  # (no soft cap in torch's sdpa: the reference's arithmetic, request by request)
            _store(k, v, kv_cache, plan, kv_scales)
            return TorchReferenceBackend.attend(q, kv_cache, metadata, scale, kv_scales, sliding_window, softcap)
        _store(k, v, kv_cache, plan, kv_scales)
        if plan.decode_blocks is not None:
            num_reqs = len(metadata.seq_lens_cpu)
            kv = _gather(kv_cache, plan.decode_blocks, kv_scales)  # (2, num_reqs * width, kv_heads, dim)
            kv = kv.view(2, num_reqs, -1, *kv.shape[2:])[:, :, :plan.decode_len]  # (2, num_reqs, len, kv_heads, dim)
            out = _attention(q[:num_reqs].unsqueeze(2), kv[0], kv[1], plan.decode_mask, scale).squeeze(2)
            if num_reqs < q.shape[0]:  # rows past the last request (padding) are zero
                out = torch.cat((out, q.new_zeros(q.shape[0] - num_reqs, *q.shape[1:])))
            return out
        if len(plan.requests) == 1 and plan.requests[0][1] == q.shape[0]:  # one request, no padding
            _, _, blocks, seq_len, mask = plan.requests[0]
            return self._one_request(q, kv_cache, blocks, seq_len, mask, scale, kv_scales)
        out = torch.zeros_like(q)  # rows past the last request (padding) stay zero
        for first, end, blocks, seq_len, mask in plan.requests:
            out[first:end] = self._one_request(q[first:end], kv_cache, blocks, seq_len, mask, scale, kv_scales)
        return out

    @staticmethod
    def _one_request(
        q: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, mask: torch.Tensor | None,
        scale: float, kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """One request's queries (q_len, heads, head_dim), the last q_len of its seq_len tokens."""
        keys, values = _gather(kv_cache, blocks, kv_scales)[:, None, :seq_len]  # each (1, len, kv_heads, dim)
        return _attention(q.transpose(0, 1)[None], keys, values, mask, scale)[0].transpose(0, 1)

    def _plan(self, metadata: AttentionMetadata, block_size: int, device: torch.device, window: int | None) -> _Plan:
        if self._planned is not None and self._planned[0] is metadata and self._planned[1] == window:
            return self._planned[2]
        plan = _make_plan(metadata, block_size, device, window)
        self._planned = (metadata, window, plan)
        return plan


def _store(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, plan: _Plan,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Write the stored rows' K and V at their slots, in one copy."""
    kv_cache = written_halves(kv_cache)  # (a latent cache's V half is its K half: kv_cache.py)
    kv = torch.stack((k, v)[:kv_cache.shape[0]])  # (2, num_tokens, num_kv_heads, head_dim)
    if plan.stored is not None:
        kv = kv[:, plan.stored]
    flat = kv_cache.flatten(1, 2)  # (2, num_blocks * block_size, num_kv_heads, head_dim), a view
    if is_fp8(kv_cache.dtype):  # (no index_copy_ for float8 on a CPU)
        for half in range(kv_cache.shape[0]):
            flat[half, plan.slots] = to_cache(kv[half], kv_cache.dtype, kv_scales, half)
    else:
        flat.index_copy_(1, plan.slots, kv if kv.dtype == kv_cache.dtype else kv.to(kv_cache.dtype))


def _make_plan(metadata: AttentionMetadata, block_size: int, device: torch.device, window: int | None) -> _Plan:
    slots = metadata.slot_mapping.long()
    real = slots >= 0
    stored = None
    if not bool(real.all()):  # (padding is rare: a row of the draft's that has no slot left)
        stored = real.nonzero().flatten()
        slots = slots[stored]
    starts, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
    num_reqs = len(seq_lens)
    tables = metadata.block_tables.long()
    if metadata.max_query_len == 1 and starts[num_reqs] == num_reqs:
        width = -(-max(seq_lens) // block_size)
        blocks = tables[:, :width]  # (the longest request's table has them all; shorter rows end in padding)
        decode_len = max(seq_lens)
        mask = None
        if num_reqs > 1 or (window is not None and decode_len > window):
            lens = torch.tensor(seq_lens, device=device)[:, None]
            keys = torch.arange(decode_len, device=device)
            mask = keys < lens  # (num_reqs, len): the request's context ...
            if window is not None:
                mask &= keys >= lens - window  # ... its last `window` keys
            mask = mask[:, None, None]  # (num_reqs, 1, 1, len)
        return _Plan(slots, stored, blocks.flatten(), decode_len, mask, [])
    requests = []
    for i, seq_len in enumerate(seq_lens):
        first, end = starts[i], starts[i + 1]
        q_len = end - first
        if q_len == 0:  # a request of no tokens (a prefill graph's padding: executor/prefill_graphs.py)
            continue
        blocks = tables[i, :-(-seq_len // block_size)]
        # Query j sits at position seq_len - q_len + j and sees keys 0 .. that position.
        mask = visible_mask(q_len, seq_len, window, device)
        requests.append((first, end, blocks, seq_len, mask))
    return _Plan(slots, stored, None, 0, None, requests)


def _gather(
    kv_cache: torch.Tensor, blocks: torch.Tensor, kv_scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """The K and V of `blocks`, side by side: (2, len(blocks) * block_size, num_kv_heads, head_dim),
    from an FP8 cache scaled back in float32 (as the reference reads it, whatever the query's dtype)."""
    kv = kv_cache.index_select(1, blocks).flatten(1, 2)
    if is_fp8(kv_cache.dtype):
        scales = torch.stack(kv_scales).float()[:, None, :, None]  # (2, 1, num_kv_heads, 1)
        kv = kv.float() * scales
    return kv


def _attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
) -> torch.Tensor:
    """q (batch, heads, q_len, head_dim); keys, values (batch, len, kv_heads, head_dim) ->
    (batch, heads, q_len, head_dim), in q's dtype (16-bit inputs accumulate in float32)."""
    dtype = q.dtype
    if dtype != torch.float32:
        q = q.float()
    if keys.dtype != torch.float32:
        keys, values = keys.float(), values.float()
    out = F.scaled_dot_product_attention(q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
                                         scale=scale, enable_gqa=True)
    return out if dtype == torch.float32 else out.to(dtype)
