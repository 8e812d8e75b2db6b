"""ferry/kernels/fused_moe.py against its torch reference, and its alignment by construction.

Without a GPU the kernels run on CPU tensors under Triton's interpreter, a few milliseconds a
program, so the experts stay small (H 64, I 32) and the shapes cover the corners without their
full product: every pair of (tokens, experts), (tokens, top-k) and (experts, top-k) from tokens
{1, 3, 64}, experts {8, 64, 128} and top-k {1, 2, 8} appears once (a Latin square), and 4096
tokens run at the heaviest corner (128 experts, top-8: 32768 pairs) and the lightest. The token
counts reach all three launch configurations (choose_config), and most pair counts are not a
multiple of BLOCK_M.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are defined
pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    from triton_interpreter import patch_interpreter

    patch_interpreter()

from ferry.kernels.fused_moe import (  # noqa: E402
    DECODE_CONFIG, align_block_size, choose_config, fused_moe, fused_moe_reference, max_blocks,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN, INTER = 64, 32
# float32: the kernel and torch differ only in the order of their float32 sums. bfloat16: besides
# that, the kernel rounds each pair's weighted output to bf16 before the sum over k, a few units
# of its 8-bit mantissa.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

# (tokens, experts, top-k)
LATIN_SQUARE = [
    (1, 8, 1), (1, 64, 2), (1, 128, 8),
    (3, 8, 8), (3, 64, 1), (3, 128, 2),
    (64, 8, 2), (64, 64, 8), (64, 128, 1),
]
LARGE = [(4096, 128, 8), (4096, 8, 1)]


def routing(tokens, experts, top_k, seed=0, id_dtype=torch.int64):
    """A router's output: top-k of random scores (distinct experts a token), weights summing to one."""
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(DEVICE), ids.to(DEVICE, id_dtype)


def layer(tokens, experts, dtype, seed=0):
    """x, w13, w2 with outputs of order one."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(experts, HIDDEN, INTER, generator=g) / INTER**0.5
    return (t.to(DEVICE, dtype) for t in (x, w13, w2))


def assert_matches_reference(x, w13, w2, topk_weights, topk_ids):
    out = fused_moe(x, w13, w2, topk_weights, topk_ids)
    expected = fused_moe_reference(x, w13, w2, topk_weights, topk_ids)
    assert out.shape == x.shape and out.dtype == x.dtype
    tol = TOLERANCE[x.dtype]
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("tokens,experts,top_k", LATIN_SQUARE + LARGE)
def test_float32_matches_reference(tokens, experts, top_k):
    x, w13, w2 = layer(tokens, experts, torch.float32)
    assert_matches_reference(x, w13, w2, *routing(tokens, experts, top_k))


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 128, 8), (64, 64, 2), (4096, 8, 1)])
def test_bfloat16_matches_reference(tokens, experts, top_k):
    x, w13, w2 = layer(tokens, experts, torch.bfloat16)
    assert_matches_reference(x, w13, w2, *routing(tokens, experts, top_k))


def test_int32_and_int64_ids_give_the_same_output():
    x, w13, w2 = layer(16, 8, torch.bfloat16)
    weights, ids = routing(16, 8, 8)
    out = fused_moe(x, w13, w2, weights, ids)
    assert torch.equal(fused_moe(x, w13, w2, weights, ids.to(torch.int32)), out)


@pytest.mark.parametrize("tokens,top_k", [(1, 8), (8, 2), (64, 2)])
def test_experts_no_token_chose_are_never_read(tokens, top_k):
    """Only the even experts are chosen, and the odd ones hold NaN: one of their values in any
    row that is stored would make it NaN."""
    experts = 64
    x, w13, w2 = layer(tokens, experts, torch.float32)
    weights, ids = routing(tokens, experts // 2, top_k)
    ids = 2 * ids
    w13[1::2], w2[1::2] = float("nan"), float("nan")
    assert_matches_reference(x, w13, w2, weights, ids)


def test_decode_batches_take_the_smallest_block():
    assert all(choose_config(pairs) == DECODE_CONFIG for pairs in range(1, 65))
    assert DECODE_CONFIG.block_m == 16


@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64], ids=str)
@pytest.mark.parametrize(
    "tokens,experts,top_k,block_m",
    # one pair; every expert chosen by every token; most experts unchosen; several chunks of pairs
    [(1, 8, 1, 16), (3, 8, 8, 16), (5, 128, 2, 32), (300, 64, 8, 64), (4096, 8, 8, 16)],
)
def test_alignment_groups_every_pair_once_in_blocks_of_one_expert(tokens, experts, top_k, block_m, id_dtype):
    _, ids = routing(tokens, experts, top_k, id_dtype=id_dtype)
    sorted_ids, expert_ids, num_padded = (t.cpu() for t in align_block_size(ids, experts, block_m))
    flat = ids.reshape(-1).cpu()
    num_pairs = flat.numel()
    counts = torch.bincount(flat, minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert num_padded.item() == padded.sum().item()
    assert sorted_ids.numel() == block_m * expert_ids.numel() == block_m * max_blocks(num_pairs, experts, block_m)
    slots = sorted_ids[: num_padded.item()]
    real = slots < num_pairs
    assert torch.equal(slots[~real], torch.full_like(slots[~real], num_pairs))  # padding: the sentinel
    assert torch.equal(slots[real].sort().values, torch.arange(num_pairs, dtype=torch.int32))  # each pair once
    # Block by block: the expert's pairs in their order, then its padding.
    expected_experts = torch.repeat_interleave(torch.arange(experts), padded // block_m)
    assert torch.equal(expert_ids[: expected_experts.numel()], expected_experts.to(torch.int32))
    for expert in flat.unique().tolist():
        group = slots[padded[:expert].sum(): padded[: expert + 1].sum()]
        pairs = torch.nonzero(flat == expert).flatten().to(torch.int32)
        assert torch.equal(group[: pairs.numel()], pairs)
