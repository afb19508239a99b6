"""What the recurrent layers (gated_deltanet.GatedDeltaNet, mamba2.Mamba2Mixer) share around their own step.

* The state tensors the runner's state cache binds (`conv_state`, `recurrent_state`: attention/state_cache.py).
* Speculative verify (device/speculative.py): a verify runs a row's Q positions from its state without writing
  it and keeps each position's inputs (`keep_verified`, into static buffers `hold_verified` sizes from the
  layer's `verified_shapes`); once the window knows how many positions each row consumed, `commit` moves the
  convolution window and the recurrent state over exactly those, by the layer's own `state_step` masked per row.
* Tensor parallelism: a rank's share of projections and per-head parameters loaded whole (`keep_rows`,
  `keep_heads`).
"""

from __future__ import annotations

import torch
from torch import nn


def keep_rows(module: nn.Module, rows: torch.Tensor) -> None:
    """Keep only `rows` of a module's weight (and bias): a rank's share of a projection loaded whole."""
    index = rows.to(module.weight.device)
    module.weight = nn.Parameter(module.weight.data[index].contiguous(), requires_grad=False)
    if getattr(module, "bias", None) is not None:
        module.bias = nn.Parameter(module.bias.data[index].contiguous(), requires_grad=False)
    if hasattr(module, "out_features"):
        module.out_features = len(rows)


class RecurrentMixer(nn.Module):
    """A subclass defines `conv1d` (causal_conv.CausalConv), `state_step(state, **position)` (one token per row:
    the new state from the kept inputs of one position) and `verified_shapes()` (per kept input, its shape after
    [rows, queries], float32)."""

    def __init__(self):
        super().__init__()
        self.conv_state: torch.Tensor | None = None  # [slots, C, K - 1], bound by the state cache
        self.recurrent_state: torch.Tensor | None = None  # [slots, ...] float32
        self.verified: dict[str, torch.Tensor] | None = None  # a verify's positions, until `commit`

    def keep_heads(self, heads: torch.Tensor, *names: str) -> None:
        """Keep only `heads` of the per-head parameters `names` (a rank's share)."""
        for name in names:
            param = getattr(self, name)
            setattr(self, name, nn.Parameter(param.data[heads.to(param.device)], requires_grad=False))

    def hold_verified(self, rows: int, queries: int) -> None:
        """Static buffers for `rows` rows of `queries` verify positions: the convolution's inputs and the
        layer's own kept inputs."""
        device = self.conv_state.device
        self.verified = {"inputs": torch.zeros(rows, queries, self.conv_state.shape[1], dtype=self.conv_state.dtype,
                                               device=device)}
        for name, shape in self.verified_shapes().items():
            self.verified[name] = torch.zeros(rows, queries, *shape, device=device)

    def keep_verified(self, **tensors: torch.Tensor) -> None:
        """A verify's positions ([B, Q, ...] each, by verified_shapes' names and "inputs") into the buffers."""
        for name, tensor in tensors.items():
            self.verified[name][: tensor.shape[0]].copy_(tensor)

    def commit(self, accepted: torch.Tensor, slots: torch.Tensor) -> None:
        """After a verify: each row's state moves over its first accepted[b] positions ([B] int64, 0..Q; 0 for
        inert rows: their state stays)."""
        rows = slots.shape[0]
        kept = {name: tensor[:rows] for name, tensor in self.verified.items()}
        inputs = kept.pop("inputs")
        self.conv1d.commit(self.conv_state, slots, inputs, accepted)
        state = self.recurrent_state.index_select(0, slots)
        for t in range(inputs.shape[1]):
            moved = self.state_step(state, **{name: tensor[:, t] for name, tensor in kept.items()})
            state = torch.where((t < accepted)[:, None, None, None], moved, state)
        self.recurrent_state.index_copy_(0, slots, state)
