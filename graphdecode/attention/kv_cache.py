"""The paged KV cache: one tensor [num_pages, 2, page_size, H_kv, D] per layer (NHD).

Page 0 is reserved as the scratch page (plan.SCRATCH_PAGE, the host's and the device's
convention): padded rows and finished rows of a decode window write their K/V there, so their
writes can never touch a live sequence.

An FP8 cache (`kv_cache_dtype="fp8"`: float8_e4m3fn, one byte an element) holds K / k_scale and
V / v_scale, each layer's scales from the checkpoint (its AttentionSpec) or 1.0, rounded to nearest
even and saturated at +-448 (`to_fp8`); readers multiply back (`from_fp8`), or fold the scales into
the scores' scale and the output (the CPU kernels, FlashInfer).
"""

from __future__ import annotations

import torch


def allocate_kv_caches(num_layers, num_pages, page_size, num_kv_heads, head_dim, dtype, device, held=None):
    """One cache per layer; held: the layers this rank attends with (a pipeline stage's), None for all: the others
    get no pages (an empty [0, 2, page_size, H_kv, D] in their place, so layer indices stay global)."""
    return [
        torch.zeros(num_pages if held is None or layer in held else 0, 2, page_size, num_kv_heads, head_dim,
                    dtype=dtype, device=device)
        for layer in range(num_layers)
    ]


def kv_bytes_per_page(num_layers, page_size, num_kv_heads, head_dim, dtype) -> int:
    return num_layers * 2 * page_size * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # E4M3's largest finite value


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as E4M3: rounded to nearest even, saturated (csrc's store(e4m3*) gives the same bytes)."""
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)


def from_fp8(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """A cache slice in `dtype`: an FP8 one times its scale, any other as it is."""
    if x.dtype != FP8:
        return x
    return (x.float() * scale).to(dtype)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Write k, v [T, H_kv, D] at slots (page * page_size + offset) [T] int64 (FP8: divided by the scales)."""
    if kv_cache.dtype == FP8:
        k, v = to_fp8(k, k_scale), to_fp8(v, v_scale)
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
    """Copy whole pages src[i] -> dst[i] ([n] int64, device) in every layer (this rank holds)."""
    for kv in kv_caches:
        if kv.shape[0]:
            kv[dst] = kv[src]
