"""The causal depthwise convolution of recurrent layers (Gated DeltaNet, Mamba2), over a per-sequence window.

`weight` [C, 1, K] and `bias` [C] (Mamba2's; None for Gated DeltaNet) under transformers' names
(`conv1d.weight`, `conv1d.bias`); the activation is silu. A sequence's window, its last K - 1 inputs, lives in
the state cache (`conv_state` [slots, C, K - 1]): prefill continues it from the slot, decode shifts it by one
input per row, a speculative verify convolves Q positions without writing it and `commit` shifts it by the
positions a round accepted. Every form is an F.conv1d (or its one-output dot product) over [window | inputs],
so the forms agree with each other and with transformers' causal_conv1d_fn / _update.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CausalConv(nn.Module):
    def __init__(self, channels: int, kernel: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None
        self.width = kernel - 1

    def decode(self, conv_state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """One input per row, x [B, C] -> [B, C]; the rows' windows shift by it."""
        window = torch.cat([conv_state.index_select(0, slots), x.to(conv_state.dtype)[:, :, None]], dim=-1)
        conv_state.index_copy_(0, slots, window[:, :, 1:])
        out = (window.to(self.weight.dtype) * self.weight[:, 0, :]).sum(-1)
        return F.silu(out if self.bias is None else out + self.bias)

    def prefill(self, conv_state: torch.Tensor, slot: int, x: torch.Tensor) -> torch.Tensor:
        """One sequence's chunk x [L, C] -> [L, C], continuing slot `slot`'s window (and moving it on)."""
        full = torch.cat([conv_state[slot], x.to(conv_state.dtype).t()], dim=-1)  # [C, K - 1 + L]
        conv_state[slot].copy_(full[:, -self.width:])
        return F.silu(F.conv1d(full[None].to(self.weight.dtype), self.weight, self.bias, groups=full.shape[0])[0]).t()

    def verify(self, conv_state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Q positions per row, x [B, Q, C] -> [B, Q, C], the windows unchanged."""
        full = torch.cat([conv_state.index_select(0, slots), x.to(conv_state.dtype).transpose(1, 2)], dim=-1)
        out = F.conv1d(full.to(self.weight.dtype), self.weight, self.bias, groups=full.shape[1])
        return F.silu(out).transpose(1, 2)

    def commit(self, conv_state: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, accepted: torch.Tensor) -> None:
        """Each row's window moves over its first accepted[b] of the positions x [B, Q, C] (0..Q)."""
        full = torch.cat([conv_state.index_select(0, slots), x.to(conv_state.dtype).transpose(1, 2)], dim=-1)
        index = (accepted[:, None] + torch.arange(self.width, device=x.device))[:, None, :]
        conv_state.index_copy_(0, slots, full.gather(2, index.expand(-1, full.shape[1], -1)))
