"""Gemma 3 text (`gemma3_text`: Gemma3ForCausalLM, e.g. gemma-3-1b): the shared decoder with Gemma's parts.

* RMSNorm scaled by (1 + weight), in float32 (`norm_offset`), on the input, after
  attention, before and after the MLP (`sandwich_norms`), and on q and k per head;
* GeGLU (gelu_pytorch_tanh) MLP; embeddings times sqrt(hidden_size), tied LM head;
* queries scaled by query_pre_attn_scalar ** -0.5, optional attention and final
  logit soft-caps (attn_logit_softcapping, final_logit_softcapping);
* interleaved layers (`layer_types`, by default five local of every six): the local
  ones attend a sliding window and rotate with their own rope (rope_local_base_freq,
  10,000), the global ones attend everything with rope_theta (1,000,000) and its scaling.

All of it is ModelConfig data (models/model_config.py) or a class flag below.
"""

from __future__ import annotations

from .decoder import DecoderForCausalLM


class Gemma3ForCausalLM(DecoderForCausalLM):
    norm_offset = True
    sandwich_norms = True
    embed_scale = True
