"""Multi-head latent attention (DeepSeek-V2 / V3's MLA, models/deepseek_v3.py), absorbed, over a latent cache.

transformers expands MLA: each cached token's latent c (kv_lora_rank values after kv_a_layernorm) goes through
kv_b_proj into every head's key k_nope (qk_nope_head_dim; beside it the shared rotated key k_rope,
qk_rope_head_dim) and value (v_head_dim). Here the paged cache holds what transformers caches, [c, k_rope] per
token (ModelConfig.head_dim = kv_lora_rank + qk_rope_head_dim) as one KV head, and attention runs in the latent
space, as FlashMLA's and FlashInfer's MLA kernels do:

* each head's q_nope goes into the latent space through its rows of kv_b_proj that make keys (W_UK):
  q_lat = W_UK^T q_nope, so that q_lat . c = q_nope . k_nope; with q_rope beside it the scores are
  transformers' (in another order of the sums);
* the values are the latents themselves (the cache's V is its K; the rope part of the output is not read), and
  each head's output is W_UV (kv_b_proj's value rows) times its attention-weighted latent.

The softmax scale is (qk_nope_head_dim + qk_rope_head_dim) ** -0.5, times YaRN's mscale(factor,
mscale_all_dim) squared where the rope is YaRN with mscale_all_dim (the family's attention_scale). DeepSeek-V3
rotates adjacent pairs (`rope_interleave`, true by default): at load the rope rows of q_b_proj (q_proj) and of
kv_a_proj_with_mqa are permuted (even dims first, then odd), so that the plain rotate-half rotary gives the same
scores (one permutation on both sides of each dot product). The per-head products run as one batched matmul,
or, on a CPU engine that keeps rows batch-invariant, as each head's panel weight (csrc/cpu_linear.cpp), whose
sums do not depend on the number of rows.

Tensor parallelism: heads split across ranks (q_b_proj / q_proj and kv_b_proj by rows, o_proj by columns);
q_a_proj, kv_a_proj_with_mqa and the latent cache (one KV head) replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..attention.spec import AttentionSpec
from .layers import FusedLinear, RMSNorm
from .parallel import RowParallelLinear, TPGroup, whole
from .parallel import split as split_rows


@dataclass(frozen=True)
class MLAConfig:
    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    @property
    def cache_dim(self) -> int:
        """What the cache holds per token: the latent and the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _deinterleave(weight: torch.Tensor, heads: int, rows: int, rope: int) -> None:
    """Each head's last `rope` rows of weight [heads x rows, K], in place: even ones first, then odd ones."""
    view = weight.data.view(heads, rows, -1)
    part = view[:, rows - rope:]
    part.copy_(torch.cat([part[:, 0::2], part[:, 1::2]], dim=1))


class MLAttention(nn.Module):
    """MLA over the paged cache's one latent KV head (the module docstring)."""

    def __init__(self, cfg, layer_idx: int, tp: TPGroup, *, spec: AttentionSpec | None = None):
        super().__init__()
        m = cfg.mla
        self.m = m
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_heads // tp.size  # this rank's
        self.spec = spec or AttentionSpec()
        self.k_scale = self.v_scale = 1.0
        hidden = cfg.hidden_size
        heads_q = split_rows(cfg.num_heads * m.qk_head_dim, tp)
        if m.q_lora_rank:
            self.q_a_proj = FusedLinear(hidden, {"all": whole(m.q_lora_rank)}, cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = FusedLinear(m.q_lora_rank, {"all": heads_q}, False)
        else:
            self.q_proj = FusedLinear(hidden, {"all": heads_q}, False)
        self.kv_a_proj_with_mqa = FusedLinear(hidden, {"all": whole(m.cache_dim)}, cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = FusedLinear(m.kv_lora_rank,
                                     {"all": split_rows(cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), tp)},
                                     False)
        self.o_proj = RowParallelLinear(cfg.num_heads * m.v_head_dim, hidden, cfg.o_proj_bias, tp)
        self.uk_panels = self.uv_panels = None  # use_cpu_kernels: each head's products as panel weights

    @property
    def attention_spec(self) -> AttentionSpec:
        return replace(self.spec, k_scale=self.k_scale, v_scale=self.v_scale)

    def post_load(self) -> None:
        """Rope rows de-interleaved; W_UK and W_UV out of kv_b_proj (as buffers [heads, ...]; kv_b_proj goes)."""
        m, heads = self.m, self.num_heads
        if m.rope_interleave:
            q = self.q_b_proj if m.q_lora_rank else self.q_proj
            _deinterleave(q.weight, heads, m.qk_head_dim, m.qk_rope_head_dim)
            _deinterleave(self.kv_a_proj_with_mqa.weight, 1, m.cache_dim, m.qk_rope_head_dim)
            if self.kv_a_proj_with_mqa.bias is not None:
                _deinterleave(self.kv_a_proj_with_mqa.bias[:, None], 1, m.cache_dim, m.qk_rope_head_dim)
        w = self.kv_b_proj.weight.detach().view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        self.register_buffer("w_uk", w[:, :m.qk_nope_head_dim].contiguous())  # [heads, nope, lora]
        self.register_buffer("w_uv", w[:, m.qk_nope_head_dim:].contiguous())  # [heads, v, lora]
        del self.kv_b_proj

    def use_cpu_kernels(self, kernels) -> None:
        """Each head's two products through its own panel weight (fixed-order sums at any row count)."""
        from .cpu_linear import PanelWeight

        self.uk_panels = [PanelWeight(w.T.contiguous(), kernels, invariant=True) for w in self.w_uk]  # [lora, nope]
        self.uv_panels = [PanelWeight(w, kernels, invariant=True) for w in self.w_uv]  # [v, lora]

    def to_latent(self, q_nope: torch.Tensor) -> torch.Tensor:
        """[T, H, nope] -> [T, H, lora]: each head's W_UK^T q_nope."""
        if self.uk_panels is not None and not torch.compiler.is_compiling():
            return torch.stack([panel.run(q_nope[:, h]) for h, panel in enumerate(self.uk_panels)], dim=1)
        return torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)

    def from_latent(self, out: torch.Tensor) -> torch.Tensor:
        """[T, H, lora] -> [T, H, v]: each head's W_UV times its attention-weighted latent."""
        if self.uv_panels is not None and not torch.compiler.is_compiling():
            return torch.stack([panel.run(out[:, h]) for h, panel in enumerate(self.uv_panels)], dim=1)
        return torch.bmm(out.transpose(0, 1), self.w_uv.transpose(1, 2)).transpose(0, 1)

    def project(self, positions, hidden, rotary):
        """(q [T, H, cache_dim] in the latent space with its rotated rope part, the token's cache row [T, 1,
        cache_dim] as its key, the same row as its value, None): decoder.Attention.project's form."""
        m, tokens = self.m, hidden.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))) if m.q_lora_rank else self.q_proj(hidden)
        q = q.view(tokens, self.num_heads, m.qk_head_dim)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        q_rope, k_rope = rotary(positions, q_rope.contiguous(), k_rope.reshape(tokens, 1, m.qk_rope_head_dim))
        q = torch.cat([self.to_latent(q_nope), q_rope], dim=-1)
        row = torch.cat([self.kv_a_layernorm(latent), k_rope[:, 0]], dim=-1)[:, None]
        return q, row, row, None

    def forward(self, positions, hidden, rotary, ctx, kv_layer: int | None = None) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, row, _, _ = self.project(positions, hidden, rotary)
        out = ctx.attend(self.layer_idx if kv_layer is None else kv_layer, q, row, row)  # [T, H, cache_dim]
        out = self.from_latent(out[..., :self.m.kv_lora_rank])
        return self.o_proj(out.reshape(tokens, -1))
