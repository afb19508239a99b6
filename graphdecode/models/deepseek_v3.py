"""DeepSeek-V3 (`deepseek_v3`: DeepseekV3ForCausalLM: DeepSeek-V3 / V3.1, Kimi-K2, Moonlight): multi-head latent
attention (models/mla.py) with mixtures of experts routed by sigmoid scores over groups (moe.py's
"sigmoid_groups"), as transformers' DeepseekV3 modules compute them.

* Attention: q from `q_a_proj` -> `q_a_layernorm` -> `q_b_proj` (or `q_proj` where `q_lora_rank` is null),
  the latent and the shared rope key from `kv_a_proj_with_mqa` (`kv_a_layernorm` on the latent), keys and values
  by `kv_b_proj`: here absorbed, over a cache of the latent and the rope key (mla.py); `rope_interleave`; the
  softmax scale qk_head_dim ** -0.5 times YaRN's mscale_all_dim factor squared.
* MLPs: the first `first_k_dense_replace` layers dense SwiGLU MLPs of `intermediate_size`, the others
  `n_routed_experts` experts of `moe_intermediate_size` beside `n_shared_experts` ungated shared experts
  (`mlp.shared_experts`), the router and its `e_score_correction_bias` in float32.
* The checkpoint's `num_nextn_predict_layers` MTP layers follow the decoder's as `model.layers.{num_hidden_layers}`
  (read by speculative decoding's "mtp", models/mtp.py).
"""

from __future__ import annotations

from .config_fields import read_bool, read_float, read_int
from .decoder import DecoderForCausalLM
from .expert_weights import ExpertFormat
from .mla import MLAConfig
from .model_config import Family, read_grouped_moe
from .moe import MoEConfig
from .rope_config import RopeRules, rope_params, yarn_mscale


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    packed_modules = {  # MLA's linears are one shard each; the dense MLPs' gate and up fused
        **{name: (name, "all") for name in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")},
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }
    checkpoint_renames = {".mlp.shared_experts.": ".mlp.shared_expert."}
    expert_format = ExpertFormat(names={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})


class DeepseekV3Family(Family):
    model_type = "deepseek_v3"
    model_class = DeepseekV3ForCausalLM
    rope = RopeRules()

    def latent_attention(self, where: str, raw: dict) -> MLAConfig:
        q_lora = raw.get("q_lora_rank", 1536)
        return MLAConfig(q_lora_rank=None if q_lora is None else read_int(where, raw, "q_lora_rank", 1536),
                         kv_lora_rank=read_int(where, raw, "kv_lora_rank", 512),
                         qk_nope_head_dim=read_int(where, raw, "qk_nope_head_dim", 128),
                         qk_rope_head_dim=read_int(where, raw, "qk_rope_head_dim", 64),
                         v_head_dim=read_int(where, raw, "v_head_dim", 128),
                         rope_interleave=read_bool(where, raw, "rope_interleave", True))

    def attention_scale(self, where: str, raw: dict) -> float:
        """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under YaRN (transformers'
        yarn_apply_mscale)."""
        mla = self.latent_attention(where, raw)
        scale = mla.qk_head_dim ** -0.5
        params = rope_params(raw, where)
        all_dim = read_float(where, params, "mscale_all_dim", 0.0, positive=False)
        if params.get("rope_type", "default") != "default" and all_dim:
            mscale = yarn_mscale(read_float(where, params, "factor", 1.0), all_dim)
            scale *= mscale * mscale
        return scale

    def nextn_layers(self, where: str, raw: dict) -> int:
        return read_int(where, raw, "num_nextn_predict_layers", 0, minimum=0)

    def moe(self, where: str, raw: dict, num_layers: int, intermediate: int) -> MoEConfig | None:
        return read_grouped_moe(where, raw, num_layers, dict(
            n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, first_k_dense_replace=3,
            n_group=8, topk_group=4, routed_scaling_factor=2.5))
