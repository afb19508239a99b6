"""gpt-oss (`gpt_oss`: gpt-oss-20b, gpt-oss-120b): attention sinks, alternating windows, YaRN, biased
clamped-SwiGLU experts, MXFP4 checkpoints.

* Attention: q/k/v/o with biases; a learned per-head sink logit (`self_attn.sinks`, [H]) joins
  every softmax's denominator (AttentionSpec.sinks: the torch backend's kernels and
  reference take it; FlashInfer's fa2 kernels have no sink input, so its runs return their
  log-sum-exp and the output is rescaled by sigmoid(ln Z - sink)); even layers attend a `sliding_window`
  (128) window, odd layers everything (`layer_types`).
* RoPE: YaRN (factor 32 over an original 4,096 positions, beta_fast 32, beta_slow 1, no
  truncation), cos/sin scaled by its attention factor (rope.py).
* RMSNorm multiplies by its weight in float32 before the cast (`norm_weight_fp32`).
* The router (`mlp.router`, [E, H] + bias) takes the top `num_experts_per_tok` logits and a
  softmax over those only; experts compute `(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)` with
  g = min(gate, 7), gate and up interleaved in the checkpoint (moe.py, expert_weights.py).
* MXFP4 checkpoints (config.json quantization_config quant_method "mxfp4", as the Hub's
  are): the experts' `_blocks` / `_scales` are dequantised at load to the compute dtype
  (mxfp4.py); the rest of the checkpoint is bf16 already.

Out of scope: the "harmony" chat format and its reasoning channels (README); plain
completions and token-id prompts work.
"""

from __future__ import annotations

from .decoder import DecoderForCausalLM
from .expert_weights import ExpertFormat


class GptOssForCausalLM(DecoderForCausalLM):
    checkpoint_renames = {".mlp.router.": ".mlp.gate."}
    expert_format = ExpertFormat(gpt_oss=True)
