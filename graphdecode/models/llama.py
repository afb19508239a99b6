"""Llama (and Mistral without sliding window) as plain nn.Modules.

Parameter names follow HuggingFace (`model.layers.N.self_attn...`), except that
q/k/v live in one fused `qkv_proj` and gate/up in one `gate_up_proj`; the loader
fills them from the unfused checkpoint tensors (see `packed_modules`).

forward() takes flattened tokens `[T]` and a ForwardContext that owns the paged
KV cache and the attention metadata, so the same module serves ragged prefill
and batched decode.

Tensor parallelism (models/parallel.py): with a TPGroup of N ranks each rank holds
its query heads, its KV heads (replicated when there are fewer than N), its share of
the MLP's intermediate size and a block of the vocabulary; o_proj and down_proj
all-reduce, the embedding all-reduces, the logits are all-gathered.
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import FusedLinear, RMSNorm, SiluAndMul
from .model_config import ModelConfig
from .parallel import ParallelLMHead, RowParallelLinear, TPGroup, VocabParallelEmbedding, kv_heads_spec, local_kv_heads
from .parallel import split as split_rows
from .rope import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads // tp.size  # this rank's
        self.num_kv_heads = local_kv_heads(cfg.num_kv_heads, tp)
        self.head_dim = cfg.head_dim
        q_spec = split_rows(cfg.num_heads * cfg.head_dim, tp)
        kv_spec = kv_heads_spec(cfg.num_kv_heads, cfg.head_dim, tp)
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q": q_spec, "k": kv_spec, "v": kv_spec}, cfg.qkv_bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_proj_bias, tp)
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
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
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        rows = split_rows(cfg.intermediate_size, tp)
        self.gate_up_proj = FusedLinear(cfg.hidden_size, {"gate": rows, "up": rows}, bias=False)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, tp)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, tp)
        self.mlp = LlamaMLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden, rotary, ctx):
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden), rotary, ctx)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
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

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = LlamaModel(cfg, tp)
        if not cfg.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp)
        self.rotary: RotaryEmbedding | None = None
        self.packed_head = None  # the LM head's cpu_linear.PackedWeight (CPU)

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
        """[R, hidden] -> [R, vocab] float32 (the same full logits on every rank)."""
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return ParallelLMHead.logits(hidden, weight, self.tp, self.config.vocab_size, self.packed_head)
