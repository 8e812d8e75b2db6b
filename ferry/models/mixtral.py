"""Mixtral: Mistral's network with a mixture of experts in place of every layer's MLP.

Each token goes to num_experts_per_tok of the num_local_experts experts (2 of 8 in Mixtral 8x7B),
weighted by their router probabilities renormalized to sum to one, kept in float32 as they scale
the experts' outputs. Checkpoints call the block `block_sparse_moe` and an expert's gate, up and
down projections w1, w3 and w2.
"""

from __future__ import annotations

from torch import nn

from ferry.config import ModelConfig
from ferry.layers.moe import MIXTRAL_EXPERT_NAMES, FusedMoE, SparseMoeBlock, TopKRouter
from ferry.models.llama import MistralForCausalLM


class MixtralForCausalLM(MistralForCausalLM):
    # Checkpoint name part -> ferry's: the decoder layer calls its feed-forward block `mlp`, as
    # transformers has done with Mixtral's since version 5.
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    def make_mlp(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        hidden, moe = config.hf_config["hidden_size"], config.moe
        return SparseMoeBlock(TopKRouter(hidden, moe), FusedMoE(hidden, moe, MIXTRAL_EXPERT_NAMES))
