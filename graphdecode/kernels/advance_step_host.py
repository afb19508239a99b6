"""advance_step on CPU tensors through csrc's host entry point `graphdecode_advance_step_host`.

That entry point loops the rows through the same `__host__ __device__` per-row functions
the CUDA kernels call (csrc/advance_step.cu), with a serial scan in place of the block
scan: comparing it with the torch reference checks the kernels' logic on a machine
without a GPU. It is a test vehicle, not a registered implementation: the op's CPU
kernel stays the torch reference.

`advance_step_host` takes the torch reference's arguments (contiguous CPU tensors,
block_table with unit column stride) plus the library to call, from
`kernel_build.host_library` + `cuda_kernels.open_host_library`, or by default
`load_host_library()` (built once into the cache directory).
"""

from __future__ import annotations

import ctypes
import functools
import os

import torch

from ..cache import cache_root
from . import build as kernel_build
from . import cuda as cuda_kernels

_CPU = torch.device("cpu")


@functools.cache
def load_host_library() -> ctypes.CDLL:
    """A library with the host entry point, built for these sources into $GRAPHDECODE_CACHE/kernels/."""
    src = kernel_build.source_dir()
    if src is None:
        raise RuntimeError("csrc/ sources are not available")
    out_dir = os.path.join(cache_root(), "kernels", f"{kernel_build.source_hash(src)}-host")
    for name in (kernel_build.LIB_NAME, kernel_build.HOST_LIB_NAME):
        if os.path.isfile(os.path.join(out_dir, name)):
            return cuda_kernels.open_host_library(os.path.join(out_dir, name))
    return cuda_kernels.open_host_library(kernel_build.host_library(out_dir, src))


def advance_step_host(
    sampled: torch.Tensor,  # [B] int64
    done: torch.Tensor,  # [B] bool
    block_table: torch.Tensor,  # [B, max_pages] int32, unit column stride
    input_ids: torch.Tensor,  # [B] int64, updated
    positions: torch.Tensor,  # [B] int64, updated
    seq_lens: torch.Tensor,  # [B] int32, updated
    slot_mapping: torch.Tensor,  # [B] int64, written
    kv_indptr: torch.Tensor,  # [B + 1] int32, written
    kv_indices: torch.Tensor,  # [B * max_pages] int32, written
    kv_last_page_len: torch.Tensor,  # [B] int32, written
    page_size: int,
    advance: bool,
    *,
    lib: ctypes.CDLL | None = None,
) -> None:
    """The torch reference's step, computed by the C host entry point on CPU tensors, in place."""
    if block_table.device != _CPU:
        raise ValueError("advance_step_host: block_table must be a CPU tensor")
    rows, max_pages = cuda_kernels.check_buffers(sampled, done, block_table, input_ids, positions, seq_lens,
                                                 slot_mapping, kv_indptr, kv_indices, kv_last_page_len, _CPU)
    for name, t in (("sampled", sampled), ("done", done), ("input_ids", input_ids), ("positions", positions),
                    ("seq_lens", seq_lens), ("slot_mapping", slot_mapping), ("kv_last_page_len", kv_last_page_len)):
        if t.numel() != rows:  # the C loop reads and writes B entries of each
            raise ValueError(f"advance_step_host: {name} must hold B = {rows} entries, not {t.numel()}")
    lib = lib if lib is not None else load_host_library()
    err = lib.graphdecode_advance_step_host(
        sampled.data_ptr(), done.data_ptr(), block_table.data_ptr(), block_table.stride(0),
        input_ids.data_ptr(), positions.data_ptr(), seq_lens.data_ptr(), slot_mapping.data_ptr(),
        kv_indptr.data_ptr(), kv_indices.data_ptr(), kv_last_page_len.data_ptr(),
        rows, max_pages, page_size, int(advance),
    )
    if err != 0:
        raise ValueError(f"graphdecode_advance_step_host rejected its arguments (error {err}): "
                         f"B={rows}, max_pages={max_pages}, page_size={page_size}, stride={block_table.stride(0)}")
