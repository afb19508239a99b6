"""Rotary position embeddings: the `llama3`, `linear`, `longrope` and `yarn` frequency scalings, partial rotary.

The cos/sin tables are computed once, in float32 exactly as transformers computes
them (position * inv_freq, then cos/sin, times the attention factor, then cast), so
positions index a table instead of recomputing per step.

Partial rotary (Phi-3's `partial_rotary_factor`): only the first `rotary_dim` dims of
each head rotate (rotate-half within them); the rest pass through.

longrope keeps two frequency sets, `short_factor` and `long_factor`; which one a
forward uses depends on the sequence's length, not on the position (models/phi3.py
explains how the engine reproduces transformers' choice). `RotaryEmbedding(long=True)`
builds the long set's table, `RotaryEmbedding.stacked` one table holding both, indexed
by position (short) and position + max_positions (long).
"""

from __future__ import annotations

import math

import torch

from .rope_config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, long: bool = False) -> torch.Tensor:
    dim = rope.rotary_dim(head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    if rope.rope_type == "longrope":  # transformers' _compute_longrope_parameters
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
        return 1.0 / (factors * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)  # [dim / 2] float32
    if rope.rope_type == "yarn":
        return _yarn_frequencies(rope, dim, rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def _yarn_frequencies(rope: RopeConfig, dim: int, pos_freqs: torch.Tensor) -> torch.Tensor:
    """YaRN (transformers' _compute_yarn_parameters): each frequency interpolated (divided by the
    factor) or extrapolated (kept) by a linear ramp over the dims between the correction bounds;
    cos and sin are scaled by the attention factor (RopeConfig.attention_factor)."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers: avoids a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding:
    """cos/sin tables [max_positions, rotary_dim] in the model dtype, on the model device."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype, device, long: bool = False):
        inv_freq = inverse_frequencies(rope, head_dim, long)
        positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotary_dim / 2] float32
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if rope.attention_factor != 1.0:
            cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
        self.cos = cos.to(device=device, dtype=dtype)  # [max_positions, rotary_dim]
        self.sin = sin.to(device=device, dtype=dtype)
        self.rotary_dim = inv_freq.numel() * 2
        self.head_dim = head_dim
        self.max_positions = max_positions

    @classmethod
    def stacked(cls, short: RotaryEmbedding, long: RotaryEmbedding) -> RotaryEmbedding:
        """One table of both: rows [0, max_positions) short, [max_positions, 2 max_positions) long."""
        both = object.__new__(cls)
        both.cos, both.sin = torch.cat([short.cos, long.cos]), torch.cat([short.sin, long.sin])
        both.rotary_dim, both.head_dim, both.max_positions = short.rotary_dim, short.head_dim, short.max_positions
        return both

    kernels = None  # the CPU's fused pass (full rotary only), attached at load

    def __call__(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, H_kv, D], positions: [T] int64 (table rows) -> rotated (q, k)."""
        if self.kernels is not None and not torch.compiler.is_compiling() \
                and q.stride(2) == 1 and k.stride(2) == 1 and q.stride(1) == q.shape[2] and k.stride(1) == k.shape[2]:
            return self.kernels.rope(q, k, self.cos, self.sin, positions.contiguous())
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, rotary_dim]
        sin = self.sin[positions].unsqueeze(1)
        if self.rotary_dim == self.head_dim:
            return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return _rotate_part(q, cos, sin, self.rotary_dim), _rotate_part(k, cos, sin, self.rotary_dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_part(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dim: int) -> torch.Tensor:
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat([rot * cos + _rotate_half(rot) * sin, rest], dim=-1)
