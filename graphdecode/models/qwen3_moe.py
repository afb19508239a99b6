"""Qwen3-MoE (`qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k RMSNorm per head)
with mixture-of-experts MLPs.

* The router (`mlp.gate`, [E, H]): softmax over all experts in float32, the top
  `num_experts_per_tok`, renormalised only with `norm_topk_prob`, then cast to the model dtype.
* Which layers are sparse: those not in `mlp_only_layers` whose (index + 1) is a multiple of
  `decoder_sparse_step`; the others have a dense SwiGLU MLP of `intermediate_size`
  (MoEConfig.sparse_layers). Each expert's size is `moe_intermediate_size`.
* Experts stored per expert as `mlp.experts.N.gate_proj` / `up_proj` / `down_proj`.
* head_dim defaults to hidden_size / num_attention_heads (unlike dense Qwen3's 128); the
  sliding window, with `use_sliding_window`, is every layer's.
"""

from __future__ import annotations

from .decoder import DecoderForCausalLM
from .expert_weights import ExpertFormat


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    expert_format = ExpertFormat(names={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})
