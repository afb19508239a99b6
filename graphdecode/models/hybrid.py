"""Hybrid decoders: attention layers and Gated DeltaNet linear-attention layers in one stack (Qwen3.5, Qwen3-Next).

`ModelConfig.layer_types` marks each decoder layer FULL (attention over the paged KV cache) or LINEAR (a
gated_deltanet.GatedDeltaNet over the sequence's state slot). Both take the shared pre-norm residual block of
models/decoder.py: an input norm, the token mixer, a post-attention norm, the MLP (a GatedMLP, or a SparseMoE
where `ModelConfig.moe` marks the layer sparse). The attention layers are decoder.Attention with its variants
as parameters (here: q/k norms, a gated output, partial rotary), numbered among themselves in the KV cache
(`ModelConfig.kv_layer`); the linear layers own their state tensors, which the runner binds (`bind_states`)
once it has sized the slots.

A family is a small file that says how config.json reads (qwen3_5.py) and sets the class flags here, or gives
its own block class (nemotron_h.py, granite_hybrid.py); the stack's forward is decoder.py's (no fused CPU decode
driver: cpu_decode.py takes plain layers only).
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.spec import AttentionSpec
from .decoder import Attention, DecoderForCausalLM, GatedMLP
from .gated_deltanet import GatedDeltaNet
from .layers import RMSNorm
from .model_config import LINEAR, ModelConfig
from .moe import SparseMoE
from .parallel import TPGroup


class HybridLayer(nn.Module):
    """Qwen3.5 / Qwen3-Next: a token mixer (linear or attention) and an MLP, each pre-normed with a residual."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, spec: AttentionSpec, norm_offset: bool):
        super().__init__()
        self.is_linear = cfg.layer_types[layer_idx] == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg.linear, cfg.hidden_size, cfg.rms_norm_eps, tp)
        else:
            self.self_attn = Attention(cfg, cfg.kv_layer(layer_idx), tp, qk_norm=cfg.qk_norm, norm_offset=norm_offset,
                                       spec=spec, output_gate=cfg.attn_output_gate)
        self.sparse = cfg.moe is not None and cfg.moe.is_sparse(layer_idx)
        self.mlp = SparseMoE(cfg.moe, cfg.hidden_size, tp) if self.sparse else GatedMLP(cfg, tp, cfg.hidden_act)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, norm_offset)

    @property
    def state_mixer(self):
        """The layer's recurrent mixer (None: an attention layer)."""
        return self.linear_attn if self.is_linear else None

    @property
    def attention(self):
        return None if self.is_linear else self.self_attn

    def forward(self, positions, hidden, rotary, ctx):
        normed = self.input_layernorm(hidden)
        if self.is_linear:
            mixed = self.linear_attn(normed, ctx)
        else:
            mixed = self.self_attn(positions, normed, rotary, ctx)
        hidden, normed = self.post_attention_layernorm.add_and_norm(hidden, mixed)
        if self.sparse:
            return hidden + self.mlp(normed, ctx.live_tokens())
        return hidden + self.mlp(normed)


class HybridForCausalLM(DecoderForCausalLM):
    layer_class = HybridLayer  # a family's decoder layer: `state_mixer` and `attention` name its parts
    packed_modules = {  # the linear layers' four input projections fill one fused in_proj
        **DecoderForCausalLM.packed_modules,
        "in_proj_qkv": ("in_proj", "qkv"),
        "in_proj_z": ("in_proj", "z"),
        "in_proj_b": ("in_proj", "b"),
        "in_proj_a": ("in_proj", "a"),
        "in_proj_qkvz": ("in_proj", "qkvz"),  # Qwen3-Next's grouped layout
        "in_proj_ba": ("in_proj", "ba"),
    }

    def make_layer(self, layer: int, tp: TPGroup) -> nn.Module:
        return self.layer_class(self.config, layer, tp, self.layer_spec(layer), self.norm_offset)

    @property
    def attention_specs(self) -> list[AttentionSpec]:
        return [layer.attention.attention_spec for layer in self.model.layers if layer.attention is not None]

    @property
    def linear_layers(self) -> list:
        """The recurrent mixers (gated_deltanet.GatedDeltaNet, mamba2.Mamba2Mixer), in layer order."""
        return [layer.state_mixer for layer in self.model.layers if layer.state_mixer is not None]

    def bind_states(self, states) -> None:
        """Give each linear layer its tensors of the state cache (states.StateCache)."""
        for layer, (conv, recurrent) in zip(self.linear_layers, states.layers):
            layer.conv_state, layer.recurrent_state = conv, recurrent

    def post_load(self, max_positions: int) -> None:
        super().post_load(max_positions)
        for layer in self.linear_layers:
            layer.post_load()

    def hold_verified(self, rows: int, queries: int) -> None:
        """Speculative decoding: each linear layer keeps a verify's positions until `commit_verified`."""
        for layer in self.linear_layers:
            layer.hold_verified(rows, queries)

    def commit_verified(self, accepted: torch.Tensor, slots: torch.Tensor) -> None:
        """After a verify round: each row's states move over the accepted[b] positions it consumed."""
        for layer in self.linear_layers:
            layer.commit(accepted, slots)

    def window_tensors(self) -> dict[str, torch.Tensor | None]:
        """A window writes the rows' states besides the KV cache (and the experts' counters)."""
        out = dict(super().window_tensors())
        for i, layer in enumerate(self.linear_layers):
            out[f"conv_state.{i}"] = layer.conv_state
            out[f"recurrent_state.{i}"] = layer.recurrent_state
            for name, tensor in (layer.verified or {}).items():
                out[f"verified.{i}.{name}"] = tensor
        return out
