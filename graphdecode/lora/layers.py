"""Every resident adapter's update to one projection, each row taking its own, in two static-shape matmuls.

For a projection of K inputs, N outputs and G fused shards (q, k, v: 3; gate, up: 2; o, down: 1), with S slots of
rank R: `A` [S G R, K] holds each slot's and shard's lora_A rows (zero past its rank), `B` [N, S G R` each one's
lora_B columns times its scaling, on the rows its shard writes. A forward of T tokens computes

    y = base(x) + B ((A x) * mask)        mask [T, S G R]: 1 on the columns of the token's slot, else 0

so a token of slot s gets exactly B_s A_s x (the other slots' columns contribute exact zeros) and a token without
an adapter (slot 0) nothing. The shapes depend on neither the batch nor which adapters it holds, so a window's
graph is captured once, and loading an adapter into a slot rewrites the buffers in place. The cost is the two
thin matmuls over all S slots' columns (S G R of them) for every token.

On a batch-invariant engine both matmuls keep a row's bits those of any batch, as the projections do: on a CPU
with the panel kernels they run on panels (cpu_linear.PanelWeight, rebuilt in place after each load), on CUDA in
fixed blocks of rows (blocked_linear.py); elsewhere F.linear on the dense buffers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..models.blocked_linear import blocked_linear


class LoRAState:
    """The forward's per-token slot masks, shared by every LoRALinear of a model; `begin` sets them per forward
    from the tokens' slots."""

    def __init__(self, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.max_loras, self.max_rank = max_loras, max_rank
        # for each group count G: the slot (1..S) owning each of the S G R columns
        self.column_slots = {g: torch.arange(max_loras * g * max_rank, device=device) // (g * max_rank) + 1
                             for g in (1, 2, 3)}
        self.dtype = dtype
        self.masks: dict[int, torch.Tensor] = {}

    def begin(self, token_slots: torch.Tensor) -> None:
        """token_slots [T] int64: each token's adapter slot (0: none)."""
        slots = token_slots[:, None]
        self.masks = {g: (slots == cols).to(self.dtype) for g, cols in self.column_slots.items()}


class _Matmul:
    """x W^T over a dense [out, in] buffer: through CPU panels refreshed from it (`kernels`), in fixed row blocks
    (`blocked`), or plainly."""

    def __init__(self, dense: torch.Tensor, kernels, blocked: bool = False):
        self.dense = dense
        self.kernels = kernels
        self.blocked = blocked
        self.panels = None
        self.refresh()

    def refresh(self) -> None:
        if self.kernels is None:
            return
        from ..models.cpu_linear import PanelWeight

        fresh = PanelWeight(self.dense, self.kernels, invariant=True)
        if self.panels is None:
            self.panels = fresh
        else:  # in place: whatever holds the old object (a graph's twin) sees the new weights
            self.panels.panels.copy_(fresh.panels)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            return self.panels.run(x)
        if self.blocked:
            return blocked_linear(x, self.dense)
        return F.linear(x, self.dense)


class LoRALinear(nn.Module):
    """A projection (layers.FusedLinear or parallel.RowParallelLinear) with every slot's LoRA update added."""

    def __init__(self, base: nn.Module, state: LoRAState, groups: int, in_features: int, out_features: int,
                 kernels=None, blocked: bool = False):
        super().__init__()
        self.base = base
        self.state = state
        self.groups = groups
        width = state.max_loras * groups * state.max_rank
        device = state.column_slots[1].device
        self.a = _Matmul(torch.zeros(width, in_features, dtype=state.dtype, device=device), kernels, blocked)
        self.b = _Matmul(torch.zeros(out_features, width, dtype=state.dtype, device=device), kernels, blocked)

    def columns(self, slot: int, group: int) -> slice:
        """The columns of slot (1..S) and shard group."""
        start = ((slot - 1) * self.groups + group) * self.state.max_rank
        return slice(start, start + self.state.max_rank)

    def load(self, slot: int, updates: list[tuple[int, int, int, torch.Tensor, torch.Tensor]]) -> None:
        """Slot's columns: zero, then each (group, row offset, rows, A [r, in], B [rows, r] scaled)."""
        first, last = self.columns(slot, 0).start, self.columns(slot, self.groups - 1).stop
        self.a.dense[first:last].zero_()
        self.b.dense[:, first:last].zero_()
        for group, offset, rows, a, b in updates:
            cols = self.columns(slot, group)
            rank = a.shape[0]
            self.a.dense[cols.start : cols.start + rank].copy_(a)
            self.b.dense[offset : offset + rows, cols.start : cols.start + rank].copy_(b)
        self.a.refresh()
        self.b.refresh()

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        h = self.a(flat) * self.state.masks[self.groups]
        return self.b(h.contiguous()).view(*shape[:-1], -1)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual + (base(x) + update): the order the CPU's one-call decode layers add them in (cpu_decode.py)."""
        y = self.base(x) + self.delta(x)
        return y if residual is None else residual + y
