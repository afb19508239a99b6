"""The paged KV cache: one tensor [num_pages, 2, page_size, H_kv, D] per layer (NHD).

Page 0 is reserved as the scratch page (plan.SCRATCH_PAGE, the host's and the device's
convention): padded rows and finished rows of a decode window write their K/V there, so their
writes can never touch a live sequence.
"""

from __future__ import annotations

import torch


def allocate_kv_caches(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device):
    return [
        torch.zeros(num_pages, 2, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        for _ in range(num_layers)
    ]


def kv_bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype) -> int:
    return num_layers * 2 * page_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, H_kv, D] at slots (page * page_size + offset) [T] int64."""
    page_size = kv_cache.shape[2]
    pages = torch.div(slot_mapping, page_size, rounding_mode="floor")
    offsets = slot_mapping - pages * page_size
    kv_cache[:, 0][pages, offsets] = k
    kv_cache[:, 1][pages, offsets] = v


def copy_slots(kv_cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy the K/V at slots src[i] -> dst[i] ([C] int64, device) of one layer's cache."""
    page_size = kv_cache.shape[2]
    kv_cache[dst // page_size, :, dst % page_size] = kv_cache[src // page_size, :, src % page_size]


def copy_page(kv_caches: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy whole pages src[i] -> dst[i] ([n] int64, device) in every layer."""
    for kv in kv_caches:
        kv[dst] = kv[src]
