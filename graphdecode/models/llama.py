"""Llama (and Mistral without sliding window) as plain nn.Modules.

Parameter names follow HuggingFace (`model.layers.N.self_attn...`), except that
q/k/v live in one fused `qkv_proj` and gate/up in one `gate_up_proj`; the loader
fills them from the unfused checkpoint tensors (see `packed_modules`).

forward() takes flattened tokens `[T]` and a ForwardContext that owns the paged
KV cache and the attention metadata, so the same module serves ragged prefill
and batched decode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .layers import FusedLinear, RMSNorm, SiluAndMul
from .model_config import ModelConfig
from .rope import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size}, cfg.qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.split_sizes = [q_size, kv_size, kv_size]

    def forward(self, positions, hidden, rotary: RotaryEmbedding, ctx) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split(self.split_sizes, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        out = ctx.attend(self.layer_idx, q, k, v)  # [T, H, D]
        return self.o_proj(out.reshape(tokens, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": size, "up": size}, bias=False)
        self.down_proj = nn.Linear(size, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, rotary, ctx):
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), rotary, ctx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (fused module name, shard)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

    def init_rotary(self, max_positions: int) -> None:
        weight = self.model.embed_tokens.weight
        self.rotary = RotaryEmbedding(
            self.config.rope, self.config.head_dim, max_positions, weight.dtype, weight.device
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, hidden]."""
        hidden = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            hidden = layer(positions, hidden, self.rotary, ctx)
        return self.model.norm(hidden)

    def decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        """One token per row: [B] -> logits [B, vocab] float32 (what a decode window compiles)."""
        return self.compute_logits(self.forward(input_ids, positions, ctx))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[R, hidden] -> [R, vocab] float32."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(hidden, weight).float()
