"""Qwen3 (dense): Llama's decoder with an RMSNorm over head_dim on every q and k head before rotary.

Qwen3Family below declares what differs: `qk_norm` (the `self_attn.q_norm` / `k_norm`
weights, [head_dim] each), an explicit head_dim (128 when config.json omits it, as
Qwen3Config's default), biases on q/k/v/o only with `attention_bias`, tied or untied
embeddings, and the sliding window when `use_sliding_window` is set: the layers
`layer_types` marks (by default those from `max_window_layers` on) attend a window, the
others everything.
"""

from __future__ import annotations

from .decoder import DecoderForCausalLM
from .model_config import Family
from .qwen2 import max_window_layer_types


class Qwen3ForCausalLM(DecoderForCausalLM):
    pass


class Qwen3Family(Family):
    model_type = "qwen3"
    model_class = Qwen3ForCausalLM
    head_dim = 128
    qk_norm = True
    window_switch = "use_sliding_window"

    def layer_types(self, where: str, raw: dict, num_layers: int) -> tuple[str, ...]:
        return max_window_layer_types(where, raw, num_layers)
