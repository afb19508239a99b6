"""gpt-oss (`gpt_oss`: gpt-oss-20b, gpt-oss-120b): attention sinks, alternating windows, YaRN, biased
clamped-SwiGLU experts, MXFP4 checkpoints.

* Attention: q/k/v/o with biases; a learned per-head sink logit (`self_attn.sinks`, [H]) joins
  every softmax's denominator (AttentionSpec.sinks: the torch backend's kernels and
  reference take it; FlashInfer's fa2 kernels have no sink input, so its runs return their
  log-sum-exp and the output is rescaled by sigmoid(ln Z - sink)); even layers attend a `sliding_window`
  (128) window, odd layers everything (`layer_types`).
* RoPE: YaRN (factor 32 over an original 4,096 positions, beta_fast 32, beta_slow 1, no
  truncation), cos/sin scaled by its attention factor (rope.py); rope_theta defaults to 150,000.
* RMSNorm multiplies by its weight in float32 before the cast (`norm_weight_fp32`).
* The router (`mlp.router`, [E, H] + bias) takes the top `num_experts_per_tok` (4) logits and a
  softmax over those only; experts compute `(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)` with
  g = min(gate, 7), gate and up interleaved in the checkpoint (moe.py, expert_weights.py).
* MXFP4 checkpoints (config.json quantization_config quant_method "mxfp4", as the Hub's
  are): the experts' `_blocks` / `_scales` are dequantised at load to the compute dtype
  (mxfp4.py); the rest of the checkpoint is bf16 already.

GptOssFamily below declares these config.json facts (GptOssConfig's defaults: head_dim 64,
a 128-token window, attention_bias on, 128 experts).

Out of scope: the "harmony" chat format and its reasoning channels (README); plain
completions and token-id prompts work.
"""

from __future__ import annotations

from .config_fields import read_float
from .decoder import DecoderForCausalLM
from .expert_weights import ExpertFormat
from .model_config import FULL, SLIDING, Family, given_layer_types, read_experts
from .moe import MoEConfig
from .rope_config import RopeRules


class GptOssForCausalLM(DecoderForCausalLM):
    checkpoint_renames = {".mlp.router.": ".mlp.gate."}
    expert_format = ExpertFormat(gpt_oss=True)


class GptOssFamily(Family):
    model_type = "gpt_oss"
    model_class = GptOssForCausalLM
    head_dim = 64
    rope = RopeRules(theta=150_000.0)
    attention_bias = True
    attn_sinks = True
    norm_weight_fp32 = True
    window_default = 128
    quantizations = ("mxfp4",)

    def layer_types(self, where: str, raw: dict, num_layers: int) -> tuple[str, ...]:
        given = given_layer_types(where, raw, num_layers)  # else GptOssConfig's: even layers local, odd global
        return given or tuple(SLIDING if (i + 1) % 2 else FULL for i in range(num_layers))

    def moe(self, where: str, raw: dict, num_layers: int, intermediate: int) -> MoEConfig:
        experts, top_k = read_experts(where, raw, "num_local_experts", 128, 4)
        return MoEConfig(experts, top_k, intermediate, routing="topk_softmax", router_bias=True, expert_bias=True,
                         activation="gpt_oss", swiglu_alpha=read_float(where, raw, "swiglu_alpha", 1.702),
                         swiglu_limit=read_float(where, raw, "swiglu_limit", 7.0))
