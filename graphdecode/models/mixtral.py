"""Mixtral (`mixtral`: Mixtral-8x7B, 8x22B): Mistral's decoder with a mixture-of-experts MLP in every layer.

* The router (`block_sparse_moe.gate`, [E, H], no bias): softmax over all experts in float32,
  the top `num_experts_per_tok` (2 of `num_local_experts`, 8, by default), renormalised to sum
  to 1; the weights stay float32 (moe.py, routing "softmax_topk").
* Experts: SwiGLU MLPs, stored per expert as `block_sparse_moe.experts.N.w1` (gate),
  `w3` (up) and `w2` (down); the loader stacks them into Experts' [E, 2I, H] / [E, H, I].
* The sliding window, when config.json has one, is every layer's; rope_theta defaults to 1e6.

The checkpoint's `block_sparse_moe` is this engine's `mlp` (checkpoint_renames).
"""

from __future__ import annotations

from .decoder import DecoderForCausalLM
from .expert_weights import ExpertFormat
from .model_config import Family, read_experts
from .moe import MoEConfig
from .rope_config import RopeRules


class MixtralForCausalLM(DecoderForCausalLM):
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}
    expert_format = ExpertFormat(names={"w1": "gate", "w3": "up", "w2": "down"})


class MixtralFamily(Family):
    model_type = "mixtral"
    model_class = MixtralForCausalLM
    rope = RopeRules(theta=1_000_000.0)

    def moe(self, where: str, raw: dict, num_layers: int, intermediate: int) -> MoEConfig:
        experts, top_k = read_experts(where, raw, "num_local_experts", 8, 2)
        return MoEConfig(experts, top_k, intermediate, renormalize=True, weights_fp32=True)
