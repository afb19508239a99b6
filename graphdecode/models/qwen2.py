"""Qwen2 / Qwen2.5: the Llama architecture with biases on q/k/v.

The differences are carried by ModelConfig (`qkv_bias`, tied embeddings, the sliding
window of the layers from `max_window_layers` on when `use_sliding_window`), so the
module tree and the checkpoint names are Llama's.
"""

from __future__ import annotations

from .llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
