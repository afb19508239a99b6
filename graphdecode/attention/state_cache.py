"""The recurrent-state cache beside the paged KV cache: one slot per sequence, for a hybrid's recurrent layers
(Gated DeltaNet, Mamba2).

Slot s of linear layer l is `layers[l] = (conv[s], recurrent[s])` (models/gated_deltanet.py says what they
hold). Slot 0 is the scratch slot: padded and finished rows of a window read and write it, as their K/V goes
to the scratch page. The scheduler hands out slots 1..num_slots-1 from a free list with the life cycle of a
sequence's pages (host/scheduler.py): taken at admission, given back when the sequence finishes, is aborted
or is preempted (its recomputation starts from a zeroed slot); n > 1 children take their own at admission
and receive a copy of the prompt's final state when its last chunk has run (`copy`, which also takes and
restores the prefix cache's snapshots).

Every sequence that holds a slot holds a row or a reserved row, so slots 1..max_batch_size never run out. The
slots after them hold the prefix cache's snapshots: a sequence's state at the end of a cached page, copied in
after the chunk that ends there and copied out when a later prompt hits those pages (host/state_slots.py).
"""

from __future__ import annotations

import math

import torch


def slot_bytes(lin, dtype: torch.dtype) -> int:
    """One slot of one layer: the convolution window (in the model's dtype) and the float32 recurrent state."""
    conv = lin.conv_dim * (lin.conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
    return conv + math.prod(lin.recurrent_shape) * 4


class StateCache:
    def __init__(self, lin, num_layers: int, num_slots: int, dtype: torch.dtype, device: torch.device):
        """lin: the layers' sizes (models/gated_deltanet.LinearAttentionConfig, models/mamba2.Mamba2Config:
        conv_dim, conv_kernel, recurrent_shape)."""
        self.num_slots = num_slots
        self.layers = [
            (torch.zeros(num_slots, lin.conv_dim, lin.conv_kernel - 1, dtype=dtype, device=device),
             torch.zeros(num_slots, *lin.recurrent_shape, dtype=torch.float32, device=device))
            for _ in range(num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.layers for t in pair)

    def reset(self, slots: torch.Tensor) -> None:
        """Zero the slots [n] int64 (a sequence's first prefill chunk starts from nothing)."""
        for conv, recurrent in self.layers:
            conv.index_fill_(0, slots, 0)
            recurrent.index_fill_(0, slots, 0)

    def copy(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots src[i] -> dst[i] ([n] int64 each) in every layer."""
        for conv, recurrent in self.layers:
            conv.index_copy_(0, dst, conv.index_select(0, src))
            recurrent.index_copy_(0, dst, recurrent.index_select(0, src))
