"""Llama (and Mistral, whose sliding window is a per-layer AttentionSpec) as plain nn.Modules.

The architecture is the shared decoder's default (models/decoder.py): pre-norm RMSNorm,
SwiGLU, rotary over the whole head, q/k/v (and o, with attention_bias) from the
unfused checkpoint tensors `q_proj`/`k_proj`/`v_proj`, `gate_proj`/`up_proj`.

Their config.json is the Family defaults (models/model_config.py): rope default, linear,
llama3 or yarn; biases on q/k/v and o with `attention_bias`. LlamaConfig has no sliding
window; Mistral's, when config.json has one, is every layer's.
"""

from __future__ import annotations

from .decoder import DecoderForCausalLM
from .model_config import Family


class LlamaForCausalLM(DecoderForCausalLM):
    pass


class LlamaFamily(Family):
    model_type = "llama"
    model_class = LlamaForCausalLM

    def sliding_window(self, where: str, raw: dict) -> None:
        return None  # LlamaConfig has no window


class MistralFamily(Family):
    model_type = "mistral"
    model_class = LlamaForCausalLM  # same architecture; its sliding window is a per-layer AttentionSpec
