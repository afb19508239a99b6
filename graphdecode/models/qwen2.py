"""Qwen2 / Qwen2.5: the Llama architecture with biases on q/k/v.

The differences are config.json facts (Qwen2Family below): biases on q/k/v always and
never on o, and a sliding window only when `use_sliding_window`, on the layers
`layer_types` marks (by default those from `max_window_layers` on); so the module tree
and the checkpoint names are Llama's.
"""

from __future__ import annotations

from .config_fields import read_int
from .llama import LlamaForCausalLM
from .model_config import FULL, SLIDING, Family, given_layer_types


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass


def max_window_layer_types(where: str, raw: dict, num_layers: int) -> tuple[str, ...]:
    """Qwen2Config's and Qwen3Config's layer kinds: config.json's layer_types, else sliding from
    max_window_layers (28) on."""
    given = given_layer_types(where, raw, num_layers)
    if given is not None:
        return given
    first = read_int(where, raw, "max_window_layers", 28, minimum=0)
    return tuple(SLIDING if i >= first else FULL for i in range(num_layers))


class Qwen2Family(Family):
    model_type = "qwen2"
    model_class = Qwen2ForCausalLM
    window_switch = "use_sliding_window"

    def layer_types(self, where: str, raw: dict, num_layers: int) -> tuple[str, ...]:
        return max_window_layer_types(where, raw, num_layers)

    def biases(self, where: str, raw: dict) -> tuple[bool, bool]:
        super().biases(where, raw)  # attention_bias is still checked
        return True, False
