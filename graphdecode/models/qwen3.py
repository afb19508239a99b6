"""Qwen3 (dense): Llama's decoder with an RMSNorm over head_dim on every q and k head before rotary.

ModelConfig carries what differs (models/model_config.py): `qk_norm` (the
`self_attn.q_norm` / `k_norm` weights, [head_dim] each), an explicit head_dim (128
when config.json omits it, as Qwen3Config's default), biases on q/k/v/o only with
`attention_bias`, tied or untied embeddings, and the sliding window when
`use_sliding_window` is set: the layers `layer_types` marks (by default those from
`max_window_layers` on) attend a window, the others everything.
"""

from __future__ import annotations

from .decoder import DecoderForCausalLM


class Qwen3ForCausalLM(DecoderForCausalLM):
    pass
