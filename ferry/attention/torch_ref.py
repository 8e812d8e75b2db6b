"""The reference attention backend: plain torch, one request at a time.

Slow but obviously correct; the fast kernels are tested against it. It reads every key and value
back out of the paged cache through the block table, even those written in this very step, so
the paging arithmetic is exercised exactly as a real kernel would use it.

An FP8 cache holds each value divided by its KV head's scale, clamped to e4m3's range and rounded
to the nearest e4m3 number; reading multiplies the scale back:

    stored = e4m3(clamp(k / k_scale[head], -448, 448))        k ~ stored * k_scale[head]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferry.attention.backend import AttentionBackend, AttentionMetadata
from ferry.quantization.e4m3 import FP8, FP8_MAX


class TorchReferenceBackend(AttentionBackend):
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
        return self.attend(q, kv_cache, metadata, scale, kv_scales, sliding_window, softcap)

    @staticmethod
    def attend(
        q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None, sliding_window: int | None, softcap: float | None,
    ) -> torch.Tensor:
        """Each request's queries over its cached keys (already stored)."""
        # Rows past the last request (padding) are attended by no one and stay zero.
        out = torch.zeros_like(q)
        starts = metadata.query_start_loc_cpu
        for i, seq_len in enumerate(metadata.seq_lens_cpu):
            if starts[i + 1] == starts[i]:  # a request of no tokens (a prefill graph's padding)
                continue
            keys, values = gather_kv(kv_cache, metadata.block_tables[i], seq_len, kv_scales)
            rows = slice(starts[i], starts[i + 1])
            out[rows] = causal_attention(q[rows], keys, values, scale, sliding_window, softcap)
        return out


def store_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Write each token's k and v at its flat slot; slot -1 marks padding and is skipped. An FP8
    cache stores k / k_scale and v / v_scale (kv_scales: two (num_kv_heads,) float32 tensors)."""
    key_cache = kv_cache[0].flatten(0, 1)  # (num_blocks * block_size, num_kv_heads, head_dim), a view
    value_cache = kv_cache[1].flatten(0, 1)
    real = slot_mapping >= 0
    if not bool(real.all()):  # (padding is rare: a step padded to a captured batch size)
        slot_mapping, k, v = slot_mapping[real], k[real], v[real]
    if is_fp8(kv_cache.dtype):  # (no index_copy_ for float8 on a CPU)
        key_cache[slot_mapping] = to_cache(k, kv_cache.dtype, kv_scales, 0)
        value_cache[slot_mapping] = to_cache(v, kv_cache.dtype, kv_scales, 1)
    else:
        key_cache.index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        value_cache.index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def gather_kv(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's first seq_len keys and values, each (seq_len, num_kv_heads, head_dim); from an
    FP8 cache in float32, scaled back."""
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-seq_len // block_size)].long()  # the ceil(seq_len / block_size) blocks in use
    keys, values = kv_cache.index_select(1, blocks).flatten(1, 2)[:, :seq_len]  # (2, seq_len, kv_heads, head_dim)
    if is_fp8(kv_cache.dtype):
        keys = keys.float() * kv_scales[0].float()[:, None]
        values = values.float() * kv_scales[1].float()[:, None]
    return keys, values


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8


def to_cache(
    x: torch.Tensor, dtype: torch.dtype, kv_scales: tuple[torch.Tensor, torch.Tensor] | None, which: int,
) -> torch.Tensor:
    """(tokens, num_kv_heads, head_dim) K (which 0) or V (1) as the cache holds them."""
    if not is_fp8(dtype):
        return x.to(dtype)
    scaled = x.float() / kv_scales[which].float()[:, None]
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(dtype)


def causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale) v for queries that are the last q_len of the keys' seq_len tokens.

    q: (q_len, num_heads, head_dim); keys, values: (seq_len, num_kv_heads, head_dim).
    Query j sits at context position seq_len - q_len + j and sees keys 0 .. that position (only the
    last sliding_window of them, if given: visible_mask); query
    head h reads KV head h // (num_heads / num_kv_heads), as HF's repeat_kv lays them out.
    Accumulates in float32 whatever the input dtype.
    """
    q_len, seq_len = q.shape[0], keys.shape[0]
    visible = visible_mask(q_len, seq_len, sliding_window, q.device)
    if softcap is not None:
        return softcapped_attention(q.float(), keys.float(), values.float(), visible, scale, softcap).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], keys.float().transpose(0, 1)[None], values.float().transpose(0, 1)[None],
        attn_mask=visible, scale=scale, enable_gqa=True,
    )  # (1, num_heads, q_len, head_dim)
    return out[0].transpose(0, 1).to(q.dtype)  # (q_len, num_heads, head_dim)


def visible_mask(q_len: int, seq_len: int, sliding_window: int | None, device) -> torch.Tensor | None:
    """(q_len, seq_len): True where query j (at position seq_len - q_len + j) may see key i:
    i <= its position (causal), and i > its position - sliding_window where there is a window. None
    where every query sees every key (one query, the last position, without a window cutting it)."""
    first = seq_len - q_len  # the first query's position
    window_cuts = sliding_window is not None and seq_len > sliding_window
    if q_len == 1 and not window_cuts:
        return None
    visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=device).tril_(first)
    if window_cuts:
        visible.triu_(first - sliding_window + 1)
    return visible


def softcapped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor | None, scale: float,
    softcap: float,
) -> torch.Tensor:
    """Attention with soft-capped scores, written out (sdpa has no soft cap), in q's dtype:
    q (q_len, num_heads, head_dim); keys, values (seq_len, num_kv_heads, head_dim)."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
