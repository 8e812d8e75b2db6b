"""Mixture-of-experts layers: the router, which picks each token's experts, and the experts, stacked
so that one kernel serves them all.

    router:   p = softmax(x W_gate^T) over the E experts, in float32; each token's k largest, as
              (T, k) weights and expert ids, renormalized to sum to one where the model does so
    experts:  out[t] = sum_j weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = ids[t, j]

Checkpoints store every expert's projections apart (model.layers.0.mlp.experts.3.gate_proj.weight);
`FusedMoE` holds them stacked, and names the part of its stacks each checkpoint tensor fills:

    w13 (E, 2 I, H):  expert e's rows  [ gate (I) | up (I) ]   as MergedLinear stacks gate_up_proj
    w2  (E, H, I):    expert e's down_proj

On CUDA the experts run in one Triton kernel (kernels/fused_moe.py); elsewhere in torch, as
transformers runs them: each expert takes the tokens routed to it, and their weighted outputs are
added back expert after expert, in order, so the sums round alike (bit for bit in bfloat16 too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferry.config import MoeConfig
from ferry.layers.norm import RMSNorm

# The names of an expert's gate, up and down projections in checkpoints.
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")

Routing = tuple[torch.Tensor, torch.Tensor]  # (topk_weights (T, k) float32, topk_ids (T, k) int64)


class TopKRouter(nn.Module):
    """The gate: router logits in the activations' dtype, their softmax in float32 (as transformers
    computes both), and each token's top k."""

    def __init__(self, hidden_size: int, moe: MoeConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.top_k = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob

    def forward(self, x: torch.Tensor) -> Routing:
        """x (T, H) -> the weights and ids of each token's experts, (T, k) each, heaviest first."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)  # (T, E)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class FusedMoE(nn.Module):
    """The routed experts of one layer, each a SiLU-gated MLP, in two stacked weights."""

    def __init__(self, hidden_size: int, moe: MoeConfig, expert_names: tuple[str, str, str]) -> None:
        super().__init__()
        experts, inter = moe.num_experts, moe.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(experts, hidden_size, inter))
        self.expert_names = expert_names

    def expert_views(self) -> dict[str, torch.Tensor]:
        """Checkpoint name below this module ("3.gate_proj.weight") -> the part of w13 or w2 it fills."""
        gate, up, down = self.expert_names
        inter = self.w2.shape[-1]
        views = {}
        for e in range(self.w13.shape[0]):
            views[f"{e}.{gate}.weight"] = self.w13[e, :inter]
            views[f"{e}.{up}.weight"] = self.w13[e, inter:]
            views[f"{e}.{down}.weight"] = self.w2[e]
        return views

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x (T, H), each token's k experts and their float32 weights (T, k) -> (T, H) in x's dtype."""
        if x.is_cuda:
            from ferry.kernels.fused_moe import fused_moe  # imports Triton: only on CUDA

            return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids)
        return torch_experts(x, self.w13, self.w2, topk_weights, topk_ids)


def torch_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts in torch, deterministic: each expert gathers its tokens (in transformers' order: by
    their choice j, then by token), runs its MLP on them, and adds their outputs, scaled in float32
    and rounded to x's dtype, into the output; no token meets an expert twice, so only the order of
    the experts orders each sum."""
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for expert in topk_ids.unique().tolist():  # (ascending)
        choice, tokens = torch.where(topk_ids.T == expert)  # (n,) each
        gate_up = F.linear(x.index_select(0, tokens), w13[expert])  # (n, 2 I)
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]  # (n, I)
        y = F.linear(h, w2[expert])  # (n, H)
        out.index_add_(0, tokens, (y.float() * topk_weights[tokens, choice, None]).to(x.dtype))
    return out


class SparseMoeBlock(nn.Module):
    """A decoder layer's feed-forward block of routed experts, in the checkpoints' names: `gate` (the
    router) and `experts`. (T, H) -> (T, H)."""

    def __init__(self, gate: TopKRouter, experts: FusedMoE) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, *self.gate(x))

    def forward_rms_norm(
        self, h: torch.Tensor, residual: torch.Tensor, norm: RMSNorm,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(norm(h + residual)), h + residual), the decoder layer's entry to the block (as
        LlamaMLP's): the router and the experts both read the normed stream."""
        x, residual = norm(h, residual)
        return self(x), residual
