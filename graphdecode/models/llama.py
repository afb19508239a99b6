"""Llama (and Mistral, whose sliding window is a per-layer AttentionSpec) as plain nn.Modules.

The architecture is the shared decoder's default (models/decoder.py): pre-norm RMSNorm,
SwiGLU, rotary over the whole head, q/k/v (and o, with attention_bias) from the
unfused checkpoint tensors `q_proj`/`k_proj`/`v_proj`, `gate_proj`/`up_proj`.
"""

from __future__ import annotations

from .decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    pass
