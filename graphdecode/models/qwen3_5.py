"""Qwen3.5 (`qwen3_5_text`: Qwen3_5ForCausalLM; `qwen3_5`: the text backbone of Qwen3_5ForConditionalGeneration;
their MoE models `qwen3_5_moe_text` / `qwen3_5_moe`): a hybrid of Gated DeltaNet and gated attention layers
(models/hybrid.py).

* layer_types: three `linear_attention` layers per `full_attention` one by default (full_attention_interval 4);
* the linear layers: linear_num_key_heads / linear_num_value_heads heads of linear_key_head_dim /
  linear_value_head_dim, a causal convolution of linear_conv_kernel_dim taps (models/gated_deltanet.py);
* the attention layers: q/k RMSNorm per head, the output gated by sigmoid of a second half of q_proj, rotary
  over partial_rotary_factor (0.25) of head_dim (256 by default). Qwen3.5's rope is multimodal (mrope: time,
  height and width positions interleaved over the rotated dims); for text every position is the same in all
  three, which is plain rope, and that is what runs;
* every RMSNorm but the linear layers' gated one scales by (1 + weight) (`norm_offset`), as Gemma's;
* the MoE models: every layer's MLP is num_experts routed experts (top num_experts_per_tok, softmax then
  renormalised) plus a shared expert scaled by sigmoid(shared_expert_gate(x)) (moe.SharedExpert).

The multimodal checkpoint (`qwen3_5`) keeps the text config under `text_config` and its weights under
`model.language_model.*` beside `model.visual.*` and `mtp.*`: only the text part is read (the vision tower is
skipped by name). Every Qwen3.5 / Qwen3-Next checkpoint's `mtp.*` layer is left to speculative decoding's
method "mtp" (models/mtp.py).
"""

from __future__ import annotations

from .config_fields import read_int
from .expert_weights import ExpertFormat
from .gated_deltanet import LinearAttentionConfig
from .hybrid import HybridForCausalLM
from .model_config import FULL, LINEAR, Family, read_experts
from .moe import MoEConfig
from .rope_config import RopeRules


class Qwen3_5ForCausalLM(HybridForCausalLM):
    norm_offset = True
    skipped_parts = ("mtp.",)  # the multi-token-prediction layer: read by models/mtp.py (method "mtp")


class Qwen3_5ConditionalForCausalLM(Qwen3_5ForCausalLM):
    """The text part of a Qwen3_5ForConditionalGeneration checkpoint."""

    checkpoint_renames = {"model.language_model.": "model."}
    skipped_parts = ("model.visual.", "mtp.")


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    expert_format = ExpertFormat(names={"gate_proj": "gate", "up_proj": "up", "down_proj": "down"})


class Qwen3_5MoeConditionalForCausalLM(Qwen3_5MoeForCausalLM):
    """The text part of a Qwen3_5MoeForConditionalGeneration checkpoint."""

    checkpoint_renames = {"model.language_model.": "model."}
    skipped_parts = ("model.visual.", "mtp.")


class Qwen3_5Family(Family):
    model_type = "qwen3_5_text"
    model_class = Qwen3_5ForCausalLM
    head_dim = 256
    rope = RopeRules(types=("default",), partial_rotary=True, partial_default=0.25)
    layout = "split"  # how the linear layers' input projections are stored (gated_deltanet.py)
    qk_norm = True
    attn_output_gate = True
    keep_layer_types = True

    def sliding_window(self, where: str, raw: dict) -> None:
        return None

    def layer_types(self, where: str, raw: dict, num_layers: int) -> tuple[str, ...]:
        given = raw.get("layer_types")
        if given is None:
            interval = read_int(where, raw, "full_attention_interval", 4)
            return tuple(LINEAR if (i + 1) % interval else FULL for i in range(num_layers))
        if not isinstance(given, list) or len(given) != num_layers or any(t not in (FULL, LINEAR) for t in given):
            raise ValueError(f"{where}: layer_types must list {FULL!r} or {LINEAR!r} for each of the "
                             f"{num_layers} layers, got {given!r}")
        return tuple(given)

    def linear_attention(self, where: str, raw: dict) -> LinearAttentionConfig:
        lin = LinearAttentionConfig(
            num_key_heads=read_int(where, raw, "linear_num_key_heads", 16),
            num_value_heads=read_int(where, raw, "linear_num_value_heads", 32),
            key_head_dim=read_int(where, raw, "linear_key_head_dim", 128),
            value_head_dim=read_int(where, raw, "linear_value_head_dim", 128),
            conv_kernel=read_int(where, raw, "linear_conv_kernel_dim", 4),
            layout=self.layout,
        )
        if lin.num_value_heads % lin.num_key_heads:
            raise ValueError(f"{where}: linear_num_value_heads ({lin.num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({lin.num_key_heads})")
        if lin.conv_kernel < 2:
            raise ValueError(f"{where}: linear_conv_kernel_dim must be at least 2, got {lin.conv_kernel}")
        return lin


class Qwen3_5ConditionalFamily(Qwen3_5Family):
    """config.json of the multimodal checkpoint: the text model's fields under text_config."""

    model_type = "qwen3_5"
    model_class = Qwen3_5ConditionalForCausalLM
    text_config = True


def shared_expert_moe(where: str, raw: dict, sparse: tuple[bool, ...], renormalize: bool) -> MoEConfig:
    """Routed experts (num_experts, top num_experts_per_tok, moe_intermediate_size each) beside a gated shared
    expert (shared_expert_intermediate_size), as Qwen3-Next and Qwen3.5-MoE route them: softmax over every
    expert in float32, the top k, renormalised (Qwen3-Next: with norm_topk_prob)."""
    experts, top_k = read_experts(where, raw, "num_experts", 512, 10)
    return MoEConfig(experts, top_k, read_int(where, raw, "moe_intermediate_size", 512), renormalize=renormalize,
                     sparse_layers=sparse, shared_intermediate_size=read_int(where, raw,
                                                                             "shared_expert_intermediate_size", 512))


class Qwen3_5MoeFamily(Qwen3_5Family):
    """Qwen3.5's MoE models (`qwen3_5_moe_text`): every layer's MLP is routed experts and a shared one."""

    model_type = "qwen3_5_moe_text"
    model_class = Qwen3_5MoeForCausalLM
    intermediate_size = 1  # unused: every layer's MLP is experts (Qwen3_5MoeTextConfig has no such field)

    def moe(self, where: str, raw: dict, num_layers: int, intermediate: int) -> MoEConfig:
        return shared_expert_moe(where, raw, (), renormalize=True)


class Qwen3_5MoeConditionalFamily(Qwen3_5MoeFamily):
    model_type = "qwen3_5_moe"
    model_class = Qwen3_5MoeConditionalForCausalLM
    text_config = True
