"""Gemma 3 text (`gemma3_text`: Gemma3ForCausalLM, e.g. gemma-3-1b): the shared decoder with Gemma's parts.

* RMSNorm scaled by (1 + weight), in float32 (`norm_offset`), on the input, after
  attention, before and after the MLP (`sandwich_norms`), and on q and k per head;
* GeGLU (`hidden_activation`, gelu_pytorch_tanh) MLP; embeddings times sqrt(hidden_size),
  tied LM head by default; head_dim 256 when config.json omits it;
* queries scaled by query_pre_attn_scalar ** -0.5 (256), optional attention and final
  logit soft-caps (attn_logit_softcapping, final_logit_softcapping);
* interleaved layers (`layer_types`, by default five local of every six,
  `sliding_window_pattern`): the local ones attend a sliding window (4,096 when config.json
  has no key) and rotate with their own rope (rope_local_base_freq, 10,000), the global
  ones attend everything with rope_theta (1,000,000) and its scaling (not yarn).

All of it is the class flags below or ModelConfig data that Gemma3Family declares.
"""

from __future__ import annotations

from .config_fields import read_bool, read_int
from .decoder import DecoderForCausalLM
from .model_config import FULL, SLIDING, Family, given_layer_types
from .rope_config import RopeConfig, RopeRules, rope_from


class Gemma3ForCausalLM(DecoderForCausalLM):
    norm_offset = True
    sandwich_norms = True
    embed_scale = True


class Gemma3Family(Family):
    model_type = "gemma3_text"
    model_class = Gemma3ForCausalLM
    head_dim = 256
    activation_key = "hidden_activation"
    activation = "gelu_pytorch_tanh"
    rope = RopeRules(types=("default", "linear", "llama3"), theta=1_000_000.0)
    tie_word_embeddings = True
    query_pre_attn_scalar = 256
    qk_norm = True
    window_default = 4096
    keep_layer_types = True  # each layer's kind picks its rope, window or not

    def sliding_window(self, where: str, raw: dict) -> int | None:
        window = super().sliding_window(where, raw)
        if raw.get("sliding_window") is not None and read_bool(where, raw, "use_bidirectional_attention"):
            raise ValueError(f"{where}: use_bidirectional_attention: bidirectional Gemma 3 is not supported")
        return window

    def layer_types(self, where: str, raw: dict, num_layers: int) -> tuple[str, ...]:
        given = given_layer_types(where, raw, num_layers)
        if given is not None:
            return given
        pattern = read_int(where, raw, "sliding_window_pattern", 6)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))

    def ropes(self, where: str, raw: dict, head_dim: int) -> tuple[RopeConfig, RopeConfig]:
        """The global layers' rope (rope_theta, with rope_scaling) and the local layers'
        (rope_local_base_freq), from rope_parameters keyed by layer type or the 4.x fields."""
        params = raw.get("rope_parameters")
        if params is None:
            scaling = raw.get("rope_scaling")
            if scaling is not None and not isinstance(scaling, dict):
                raise ValueError(f"{where}: rope_scaling must be an object or null, got {scaling!r}")
            full = dict(scaling or {}, rope_theta=raw.get("rope_theta", 1_000_000.0))
            local = {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 10_000.0)}
        elif isinstance(params, dict) and set(params) <= {FULL, SLIDING}:
            full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
        else:
            raise ValueError(f"{where}: rope_parameters must map {FULL!r} and {SLIDING!r} to rope parameters, "
                             f"got {params!r}")
        return (rope_from(raw, where, self.model_type, self.rope, full, head_dim),
                rope_from(raw, where, self.model_type, self.rope, local, head_dim, theta=10_000.0))
