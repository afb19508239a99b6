"""GLM-4.5 / GLM-4.6 / GLM-4.7 (`glm4_moe`: Glm4MoeForCausalLM): Llama's decoder with DeepSeek-V3's routing.

* Attention: q/k/v with biases (`attention_bias`), o_proj without; q/k RMSNorms over head_dim where
  `use_qk_norm`; rotary over the first half of each head (`partial_rotary_factor` 0.5, rotate-half pairs).
* MLPs: the first `first_k_dense_replace` layers dense SwiGLU MLPs of `intermediate_size`; the others
  `n_routed_experts` experts of `moe_intermediate_size` beside `n_shared_experts` ungated shared experts (one
  SwiGLU MLP of n_shared_experts x moe_intermediate_size, `mlp.shared_experts`), routed as DeepSeek-V3 routes
  (moe.py's "sigmoid_groups": sigmoid scores, `mlp.gate.e_score_correction_bias` for the choice, `n_group`
  groups of which `topk_group` are eligible, `norm_topk_prob`, `routed_scaling_factor`), the router and its
  bias in float32 as transformers keeps them.
* The checkpoint's `num_nextn_predict_layers` multi-token-prediction layers follow the decoder's as
  `model.layers.{num_hidden_layers}...`: skipped here, read by speculative decoding's `{"method": "mtp"}`
  (models/mtp.py).
"""

from __future__ import annotations

from .config_fields import read_bool, read_int
from .decoder import DecoderForCausalLM
from .expert_weights import ExpertFormat
from .model_config import Family, read_grouped_moe
from .moe import MoEConfig
from .rope_config import RopeRules


class Glm4MoeForCausalLM(DecoderForCausalLM):
    checkpoint_renames = {".mlp.shared_experts.": ".mlp.shared_expert."}
    expert_format = ExpertFormat(names={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})


class Glm4MoeFamily(Family):
    model_type = "glm4_moe"
    model_class = Glm4MoeForCausalLM
    rope = RopeRules(partial_rotary=True, partial_default=0.5)

    def uses_qk_norm(self, where: str, raw: dict) -> bool:
        return read_bool(where, raw, "use_qk_norm", False)

    def biases(self, where: str, raw: dict) -> tuple[bool, bool]:
        return read_bool(where, raw, "attention_bias", False), False

    def nextn_layers(self, where: str, raw: dict) -> int:
        return read_int(where, raw, "num_nextn_predict_layers", 0, minimum=0)

    def moe(self, where: str, raw: dict, num_layers: int, intermediate: int) -> MoEConfig | None:
        return read_grouped_moe(where, raw, num_layers, dict(
            n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408, first_k_dense_replace=1,
            n_group=1, topk_group=1, routed_scaling_factor=1.0))
