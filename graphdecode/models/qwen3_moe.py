"""Qwen3-MoE (`qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm per head)
with mixture-of-experts MLPs.

* The router (`mlp.gate`, [E, H]): softmax over all experts in float32, the top
  `num_experts_per_tok` (8), renormalised only with `norm_topk_prob`, then cast to the model dtype.
* Which layers are sparse: those not in `mlp_only_layers` whose (index + 1) is a multiple of
  `decoder_sparse_step`; the others have a dense SwiGLU MLP of `intermediate_size`
  (MoEConfig.sparse_layers). Each expert's size is `moe_intermediate_size`.
* Experts stored per expert as `mlp.experts.N.gate_proj` / `up_proj` / `down_proj`.
* head_dim defaults to hidden_size / num_attention_heads (unlike dense Qwen3's 128); the
  sliding window (4,096 when config.json has no key), with `use_sliding_window`, is every layer's.
"""

from __future__ import annotations

from .config_fields import read_bool, read_int
from .decoder import DecoderForCausalLM
from .expert_weights import ExpertFormat
from .model_config import Family, read_experts
from .moe import MoEConfig


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    expert_format = ExpertFormat(names={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})


class Qwen3MoeFamily(Family):
    model_type = "qwen3_moe"
    model_class = Qwen3MoeForCausalLM
    qk_norm = True
    window_switch = "use_sliding_window"
    window_default = 4096

    def moe(self, where: str, raw: dict, num_layers: int, intermediate: int) -> MoEConfig:
        key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
        experts, top_k = read_experts(where, raw, key, 128, 8)
        step = read_int(where, raw, "decoder_sparse_step", 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in dense
        ):
            raise ValueError(f"{where}: mlp_only_layers must list layer indices below {num_layers}, got {dense!r}")
        sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
        return MoEConfig(experts, top_k, read_int(where, raw, "moe_intermediate_size", 768),
                         renormalize=read_bool(where, raw, "norm_topk_prob"), sparse_layers=sparse)
