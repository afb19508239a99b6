"""The CPU kernel's decode and verify as torch.library custom ops, for compiled CPU windows.

Eager windows call the backend directly (no dispatcher in the way). Under torch.compile
the backend calls these opaque ops instead, named by the backend's handle
(attention/handles.py): each writes the step's K/V into the layer's cache by slot and
attends the pages in place, so the cache never goes through functionalization (which
would copy it every step) and no gather enters the graph.
"""

from __future__ import annotations

import torch

from .handles import backend_for


@torch.library.custom_op("graphdecode::cpu_paged_decode", mutates_args=())
def cpu_paged_decode(
    q: torch.Tensor,  # [B, H, D]
    k: torch.Tensor,  # [B, H_kv, D]
    v: torch.Tensor,  # [B, H_kv, D]
    slot_mapping: torch.Tensor,  # [B] int64
    seq_lens: torch.Tensor,  # [B] int32
    block_table: torch.Tensor,  # [B, W] int32
    handle: int,
    layer: int,
) -> torch.Tensor:  # [B, H, D]
    return backend_for(handle).run_paged_decode(layer, q, k, v, slot_mapping, seq_lens, block_table)


@cpu_paged_decode.register_fake
def _(q, k, v, slot_mapping, seq_lens, block_table, handle, layer):
    return torch.empty_like(q)


@torch.library.custom_op("graphdecode::cpu_paged_verify", mutates_args=())
def cpu_paged_verify(
    q: torch.Tensor,  # [B * Q, H, D]
    k: torch.Tensor,  # [B * Q, H_kv, D]
    v: torch.Tensor,  # [B * Q, H_kv, D]
    slot_mapping: torch.Tensor,  # [B * Q] int64
    query_positions: torch.Tensor,  # [B, Q] int64
    block_table: torch.Tensor,  # [B, W] int32
    handle: int,
    layer: int,
) -> torch.Tensor:  # [B * Q, H, D]
    return backend_for(handle).run_paged_verify(layer, q, k, v, slot_mapping, query_positions, block_table)


@cpu_paged_verify.register_fake
def _(q, k, v, slot_mapping, query_positions, block_table, handle, layer):
    return torch.empty_like(q)
