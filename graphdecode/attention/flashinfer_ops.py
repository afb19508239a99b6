"""FlashInfer attention as torch.library custom ops, so torch.compile sees one opaque op.

The backend is named by an integer handle (attention/handles.py). Each op writes the
new K/V into the layer's paged cache by slot, then attends. The cache write is
invisible to torch.compile (the cache is not an op argument): the op is opaque and
every call's output is used, so it is never reordered past its consumer nor dropped,
and the cache never goes through functionalization, which could copy it.
"""

from __future__ import annotations

import torch

from .handles import backend_for


@torch.library.custom_op("graphdecode::flashinfer_prefill", mutates_args=())
def flashinfer_prefill(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, H_kv, D]
    v: torch.Tensor,  # [T, H_kv, D]
    slot_mapping: torch.Tensor,  # [T] int64
    handle: int,
    layer: int,
) -> torch.Tensor:  # [T, H, D]
    return backend_for(handle).run_prefill(layer, q, k, v, slot_mapping)


@flashinfer_prefill.register_fake
def _(q, k, v, slot_mapping, handle, layer):
    return torch.empty_like(q)


@torch.library.custom_op("graphdecode::flashinfer_decode", mutates_args=())
def flashinfer_decode(
    q: torch.Tensor,  # [B, H, D]
    k: torch.Tensor,  # [B, H_kv, D]
    v: torch.Tensor,  # [B, H_kv, D]
    slot_mapping: torch.Tensor,  # [B] int64
    handle: int,
    layer: int,
) -> torch.Tensor:  # [B, H, D]
    return backend_for(handle).run_decode(layer, q, k, v, slot_mapping)


@flashinfer_decode.register_fake
def _(q, k, v, slot_mapping, handle, layer):
    return torch.empty_like(q)


@torch.library.custom_op("graphdecode::flashinfer_verify", mutates_args=())
def flashinfer_verify(
    q: torch.Tensor,  # [B * Q, H, D]
    k: torch.Tensor,  # [B * Q, H_kv, D]
    v: torch.Tensor,  # [B * Q, H_kv, D]
    slot_mapping: torch.Tensor,  # [B * Q] int64
    handle: int,
    layer: int,
    bucket: int,
) -> torch.Tensor:  # [B * Q, H, D]
    return backend_for(handle).run_verify(layer, q, k, v, slot_mapping, bucket)


@flashinfer_verify.register_fake
def _(q, k, v, slot_mapping, handle, layer, bucket):
    return torch.empty_like(q)
