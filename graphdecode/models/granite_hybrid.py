"""Granite 4.0-H (`granitemoehybrid`: GraniteMoeHybridForCausalLM, e.g. granite-4.0-h-micro): Mamba2 layers and
attention layers, each followed by a shared SwiGLU MLP (models/hybrid.py's stack, models/mamba2.py's layer).

* `layer_types`: `linear_attention` (Mamba2, `model.layers.N.mamba.*`, sized by the `mamba_*` fields; head_dim
  "auto" is mamba_expand * hidden_size / mamba_n_heads) or `full_attention` (`self_attn`, rope only with
  position_embedding_type "rope");
* every layer: input_layernorm, the mixer, `residual + out * residual_multiplier`, post_attention_layernorm, the
  shared MLP (`shared_mlp.input_linear`: gate then up rows in one tensor; `output_linear`: moe.SharedExpert's
  layout under other names), the same residual;
* Granite's multipliers: embeddings times embedding_multiplier, the queries scaled by attention_multiplier
  (in place of head_dim ** -0.5), logits divided by logits_scaling;
* the MoE models (num_local_experts > 0: Granite 4.0-H Tiny / Small): beside the shared MLP, `block_sparse_moe`,
  `num_local_experts` SwiGLU experts of `intermediate_size` (`input_linear` [E, 2I, H]: each expert's gate rows,
  then its up rows; `output_linear` [E, H, I]) routed by `router.layer`: the top `num_experts_per_tok` logits,
  a softmax over those (moe.py's "topk_softmax"); the layer adds the experts' output and the shared MLP's, then
  the residual as above.
"""

from __future__ import annotations

from torch import nn

from ..attention.spec import AttentionSpec
from .config_fields import read_bool, read_float, read_int
from .decoder import Attention
from .expert_weights import ExpertFormat
from .layers import RMSNorm
from .mamba2 import Mamba2Config, Mamba2Mixer, check_mamba, read_time_step_limit
from .model_config import FULL, LINEAR, Family, ModelConfig, read_experts
from .moe import MoEConfig, SharedExpert, SparseMoE
from .nemotron_h import NemotronHForCausalLM
from .parallel import TPGroup


class GraniteHybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, spec: AttentionSpec, norm_offset: bool):
        super().__init__()
        self.kind = cfg.layer_types[layer_idx]
        self.scale = cfg.residual_multiplier
        if self.kind == LINEAR:
            self.mamba = Mamba2Mixer(cfg.linear, cfg.hidden_size, cfg.rms_norm_eps, tp)
        else:
            self.self_attn = Attention(cfg, cfg.kv_layer(layer_idx), tp, spec=spec, rope=cfg.rope_enabled)
        self.shared_mlp = SharedExpert(cfg.hidden_size, cfg.intermediate_size, tp)
        self.sparse = cfg.moe is not None
        if self.sparse:
            self.block_sparse_moe = SparseMoE(cfg.moe, cfg.hidden_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def mlp(self):
        """The layer's mixture of experts (the model's moe_layers and counters read it)."""
        return self.block_sparse_moe if self.sparse else None

    @property
    def state_mixer(self):
        return self.mamba if self.kind == LINEAR else None

    @property
    def attention(self):
        return self.self_attn if self.kind == FULL else None

    def forward(self, positions, hidden, rotary, ctx):
        normed = self.input_layernorm(hidden)
        mixed = self.mamba(normed, ctx) if self.kind == LINEAR else self.self_attn(positions, normed, rotary, ctx)
        hidden = hidden + mixed * self.scale
        normed = self.post_attention_layernorm(hidden)
        if self.sparse:
            return hidden + (self.block_sparse_moe(normed, ctx.live_tokens()) + self.shared_mlp(normed)) * self.scale
        return hidden + self.shared_mlp(normed) * self.scale


class GraniteHybridForCausalLM(NemotronHForCausalLM):
    layer_class = GraniteHybridLayer
    # shared_mlp.input_linear holds gate's rows, then up's: moe.SharedExpert's fused gate_up_proj
    checkpoint_renames = {".shared_mlp.input_linear.": ".shared_mlp.gate_up_proj.",
                          ".shared_mlp.output_linear.": ".shared_mlp.down_proj.",
                          # the experts, stacked: [E, 2I, H] gate rows then up rows, [E, H, I]; the router
                          ".block_sparse_moe.input_linear.weight": ".block_sparse_moe.experts.gate_up_proj",
                          ".block_sparse_moe.output_linear.weight": ".block_sparse_moe.experts.down_proj",
                          ".block_sparse_moe.router.layer.": ".block_sparse_moe.gate."}
    fused_checkpoint = {"gate_up_proj": ("gate", "up")}
    expert_format = ExpertFormat()


class GraniteHybridFamily(Family):
    model_type = "granitemoehybrid"
    model_class = GraniteHybridForCausalLM
    keep_layer_types = True
    intermediate_key = "shared_intermediate_size"  # the shared MLP's (intermediate_size sizes no layer)

    def sliding_window(self, where: str, raw: dict) -> None:
        return None

    def layer_types(self, where: str, raw: dict, num_layers: int) -> tuple[str, ...]:
        given = raw.get("layer_types") or raw.get("layers_block_type")
        aliases = {"mamba": LINEAR, "attention": FULL, LINEAR: LINEAR, FULL: FULL}
        if not isinstance(given, list) or len(given) != num_layers or any(t not in aliases for t in given):
            raise ValueError(f"{where}: layer_types must list {LINEAR!r} (mamba) or {FULL!r} (attention) for each "
                             f"of the {num_layers} layers, got {given!r}")
        return tuple(aliases[t] for t in given)

    def moe(self, where: str, raw: dict, num_layers: int, intermediate: int) -> MoEConfig | None:
        experts = read_int(where, raw, "num_local_experts", 0, minimum=0)
        if not experts:
            return None
        experts, top_k = read_experts(where, raw, "num_local_experts", experts, 2)
        return MoEConfig(experts, top_k, read_int(where, raw, "intermediate_size"), routing="topk_softmax")

    def linear_attention(self, where: str, raw: dict) -> Mamba2Config:
        heads = read_int(where, raw, "mamba_n_heads", 128)
        inner = read_int(where, raw, "mamba_expand", 2) * read_int(where, raw, "hidden_size")
        head_dim = raw.get("mamba_d_head", "auto")
        head_dim = inner // heads if head_dim in ("auto", None) else read_int(where, raw, "mamba_d_head")
        if head_dim * heads != inner:
            raise ValueError(f"{where}: mamba_d_head ({head_dim}) x mamba_n_heads ({heads}) must equal mamba_expand x "
                             f"hidden_size ({inner})")
        cfg = Mamba2Config(
            num_heads=heads, head_dim=head_dim,
            state_size=read_int(where, raw, "mamba_d_state", 256),
            n_groups=read_int(where, raw, "mamba_n_groups", 1),
            conv_kernel=read_int(where, raw, "mamba_d_conv", 4),
            chunk_size=read_int(where, raw, "mamba_chunk_size", 256),
            conv_bias=read_bool(where, raw, "mamba_conv_bias", True),
            proj_bias=read_bool(where, raw, "mamba_proj_bias"),
            time_step_limit=read_time_step_limit(where, raw),
        )
        return check_mamba(where, cfg, "mamba_n_heads", "mamba_n_groups", "mamba_d_conv")

    def rope_enabled(self, where: str, raw: dict) -> bool:
        kind = raw.get("position_embedding_type")
        if kind not in (None, "rope", "nope"):
            raise ValueError(f"{where}: position_embedding_type: {kind!r} is not supported (rope, or none)")
        return kind == "rope"

    def multipliers(self, where: str, raw: dict) -> tuple[float, float, float]:
        return tuple(read_float(where, raw, key, 1.0)
                     for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling"))

    def attention_scale(self, where: str, raw: dict) -> float:
        return read_float(where, raw, "attention_multiplier", 1.0)
