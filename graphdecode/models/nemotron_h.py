"""Nemotron-H (`nemotron_h`: NemotronHForCausalLM, e.g. Nemotron-H-8B / 4B): Mamba2 layers, attention layers and MLP
layers, one mixer per block (models/hybrid.py's stack, models/mamba2.py's layer).

* `layers_block_type` (or the older `hybrid_override_pattern`, M / * / - / E) gives each block's mixer:
  `linear_attention` (Mamba2), `full_attention` (attention without any position encoding: no rope), `mlp`
  (up_proj, relu squared, down_proj: no gate), `moe` (Nemotron 3: `n_routed_experts` relu-squared experts of
  `moe_intermediate_size` beside an ungated relu-squared shared expert of
  `moe_shared_expert_intermediate_size`, `mixer.shared_experts`; routed as DeepSeek-V3 routes, moe.py's
  "sigmoid_groups", the router and its `e_score_correction_bias` held in float32; with `moe_latent_size`
  (Nemotron 3 Super) the experts work in that latent width, between `mixer.fc1_latent_proj` and
  `mixer.fc2_latent_proj`, the router and the shared expert on the full hidden state);
* every block is `hidden + mixer(norm(hidden))`, the RMSNorm multiplying by its weight in float32
  (`layer_norm_epsilon`); weights under `backbone.` (`embeddings`, `layers.N.norm` / `mixer`, `norm_f`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.spec import AttentionSpec
from .config_fields import read_bool, read_int
from .decoder import Attention, DecoderForCausalLM
from .expert_weights import ExpertFormat
from .hybrid import HybridForCausalLM
from .layers import FusedLinear, RMSNorm
from .mamba2 import Mamba2Config, Mamba2Mixer, check_mamba, read_time_step_limit
from .model_config import FULL, LINEAR, MLP_ONLY, MOE_ONLY, Family, ModelConfig, read_experts, read_group_routed_moe
from .moe import MoEConfig, SparseMoE
from .parallel import RowParallelLinear, TPGroup
from .parallel import split as split_rows

_PATTERN = {"M": LINEAR, "*": FULL, "-": MLP_ONLY, "E": MOE_ONLY}


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x)) ** 2): Nemotron-H's MLP blocks."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup):
        super().__init__()
        self.up_proj = FusedLinear(hidden_size, {"up": split_rows(intermediate_size, tp)}, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class NemotronHBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, spec: AttentionSpec, norm_offset: bool):
        super().__init__()
        self.kind = cfg.layer_types[layer_idx]
        self.sparse = self.kind == MOE_ONLY
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weight_fp32=True)
        if self.kind == LINEAR:
            self.mixer = Mamba2Mixer(cfg.linear, cfg.hidden_size, cfg.rms_norm_eps, tp)
        elif self.kind == FULL:
            self.mixer = Attention(cfg, cfg.kv_layer(layer_idx), tp, spec=spec, rope=cfg.rope_enabled)
        elif self.sparse:
            self.mixer = SparseMoE(cfg.moe, cfg.hidden_size, tp)
        else:
            self.mixer = ReluSquaredMLP(cfg.hidden_size, cfg.intermediate_size, tp)

    @property
    def mlp(self):
        """The block's mixture of experts (the model's moe_layers and counters read it)."""
        return self.mixer if self.sparse else None

    @property
    def state_mixer(self):
        return self.mixer if self.kind == LINEAR else None

    @property
    def attention(self):
        return self.mixer if self.kind == FULL else None

    def forward(self, positions, hidden, rotary, ctx):
        normed = self.norm(hidden)
        if self.kind == LINEAR:
            return hidden + self.mixer(normed, ctx)
        if self.kind == FULL:
            return hidden + self.mixer(positions, normed, rotary, ctx)
        if self.sparse:  # an MoE counts the live tokens it routes
            return hidden + self.mixer(normed, ctx.live_tokens())
        return hidden + self.mixer(normed)


class NemotronHForCausalLM(HybridForCausalLM):
    layer_class = NemotronHBlock
    packed_modules = {  # q/k/v fused; Mamba2's in_proj and the MLPs' up_proj are one-shard column linears
        **{k: v for k, v in DecoderForCausalLM.packed_modules.items() if v[0] == "qkv_proj"},
        "in_proj": ("in_proj", "all"),
        "up_proj": ("up_proj", "up"),
        "fc1_latent_proj": ("fc1_latent_proj", "all"),  # Nemotron 3 Super's latent MoE, replicated
        "fc2_latent_proj": ("fc2_latent_proj", "all"),
    }
    checkpoint_renames = {"backbone.embeddings.": "model.embed_tokens.", "backbone.norm_f.": "model.norm.",
                          "backbone.": "model.", ".mixer.shared_experts.": ".mixer.shared_expert."}
    expert_format = ExpertFormat(names={"up_proj": "up", "down_proj": "down"})


class NemotronHFamily(Family):
    model_type = "nemotron_h"
    model_class = NemotronHForCausalLM
    activation_key = "mlp_hidden_act"
    activation = "relu2"
    activations = ("relu2",)
    norm_eps_key = "layer_norm_epsilon"
    head_dim = 128
    keep_layer_types = True
    norm_weight_fp32 = True

    def sliding_window(self, where: str, raw: dict) -> None:
        return None

    def num_layers(self, where: str, raw: dict) -> int:
        return len(self._block_types(where, raw))

    def layer_types(self, where: str, raw: dict, num_layers: int) -> tuple[str, ...]:
        return self._block_types(where, raw)

    def _block_types(self, where: str, raw: dict) -> tuple[str, ...]:
        given = raw.get("layers_block_type")
        if given is None:
            pattern = raw.get("hybrid_override_pattern")
            if not isinstance(pattern, str) or not pattern or any(ch not in _PATTERN for ch in pattern):
                raise ValueError(f"{where}: layers_block_type (or hybrid_override_pattern, a string of M, *, - and E) "
                                 f"is required, got {pattern!r}")
            given = [_PATTERN[ch] for ch in pattern]
        if not isinstance(given, list) or not given or any(t not in _PATTERN.values() for t in given):
            raise ValueError(f"{where}: layers_block_type must list {LINEAR!r}, {FULL!r}, {MLP_ONLY!r} or 'moe' "
                             f"for each layer, got {given!r}")
        return tuple(given)

    def moe(self, where: str, raw: dict, num_layers: int, intermediate: int) -> MoEConfig | None:
        if MOE_ONLY not in self._block_types(where, raw):
            return None
        latent = 0 if raw.get("moe_latent_size") is None else read_int(where, raw, "moe_latent_size")
        experts, top_k = read_experts(where, raw, "n_routed_experts", 8, 2)
        return read_group_routed_moe(
            where, raw, experts, top_k, read_int(where, raw, "moe_intermediate_size", 7688), activation="relu2",
            shared_intermediate_size=read_int(where, raw, "moe_shared_expert_intermediate_size", 7688, minimum=0),
            shared_gate=False, latent_size=latent)

    def linear_attention(self, where: str, raw: dict) -> Mamba2Config:
        if raw.get("mamba_hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: mamba_hidden_act: {raw['mamba_hidden_act']!r} is not supported (silu)")
        if read_bool(where, raw, "residual_in_fp32"):
            raise ValueError(f"{where}: residual_in_fp32: a float32 residual stream is not supported")
        cfg = Mamba2Config(
            num_heads=read_int(where, raw, "mamba_num_heads", 128),
            head_dim=read_int(where, raw, "mamba_head_dim", 64),
            state_size=read_int(where, raw, "ssm_state_size", 128),
            n_groups=read_int(where, raw, "n_groups", 8),
            conv_kernel=read_int(where, raw, "conv_kernel", 4),
            chunk_size=read_int(where, raw, "chunk_size", 128),
            conv_bias=read_bool(where, raw, "use_conv_bias", True),
            proj_bias=read_bool(where, raw, "use_bias"),
            time_step_limit=read_time_step_limit(where, raw),
        )
        return check_mamba(where, cfg, "mamba_num_heads", "n_groups", "conv_kernel")

    def rope_enabled(self, where: str, raw: dict) -> bool:
        return False  # Nemotron-H's attention has no position encoding
