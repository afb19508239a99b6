"""Loads csrc's CUDA library with ctypes and registers it as the CUDA kernel of
`graphdecode::advance_step` (whose CPU/meta implementation is the torch reference).

Search order: the library setup.py built into the package (if it matches the
sources), else one built at first use with nvcc into the cache directory, for this
GPU's architecture.
"""

from __future__ import annotations

import ctypes
import os

import torch

from . import kernel_build
from .advance_step import advance_step

ABI_VERSION = 1
_lib: ctypes.CDLL | None = None
_registered = False


def library_path() -> str:
    src = kernel_build.source_dir()
    packaged = os.path.join(kernel_build.package_dir(), "_kernels", kernel_build.LIB_NAME)
    if kernel_build.is_current(packaged, src):
        return packaged
    if src is None:
        raise RuntimeError("graphdecode's CUDA library is missing and csrc/ sources are not available")
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    cache = os.environ.get("GRAPHDECODE_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "graphdecode"))
    tag = f"{kernel_build.source_hash(src)}-sm{''.join(map(str, capability)) if capability else 'default'}"
    path = os.path.join(cache, "kernels", tag, kernel_build.LIB_NAME)
    if not os.path.isfile(path):
        kernel_build.build(path, src, kernel_build.arch_flags_for(capability))
    return path


def load_library(path: str | None = None) -> ctypes.CDLL:
    global _lib
    if _lib is not None and path is None:
        return _lib
    lib = ctypes.CDLL(path or library_path())
    lib.graphdecode_kernels_abi_version.restype = ctypes.c_int
    if lib.graphdecode_kernels_abi_version() != ABI_VERSION:
        raise RuntimeError("graphdecode CUDA library has an unexpected ABI version; rebuild csrc/")
    p = ctypes.c_void_p
    lib.graphdecode_advance_step.restype = ctypes.c_int
    lib.graphdecode_advance_step.argtypes = [
        p, p, p, ctypes.c_int64, p, p, p, p, p, p, p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, p,
    ]
    if path is None:
        _lib = lib
    return lib


def _advance_step_cuda(sampled, done, block_table, input_ids, positions, seq_lens, slot_mapping,
                       kv_indptr, kv_indices, kv_last_page_len, page_size, advance) -> None:
    lib = load_library()
    rows, max_pages = block_table.shape
    err = lib.graphdecode_advance_step(
        sampled.data_ptr(), done.data_ptr(), block_table.data_ptr(), block_table.stride(0),
        input_ids.data_ptr(), positions.data_ptr(), seq_lens.data_ptr(), slot_mapping.data_ptr(),
        kv_indptr.data_ptr(), kv_indices.data_ptr(), kv_last_page_len.data_ptr(),
        rows, max_pages, page_size, int(advance), torch.cuda.current_stream().cuda_stream,
    )
    if err != 0:
        raise RuntimeError(f"graphdecode_advance_step failed with CUDA error {err}")


def register() -> None:
    """Make `graphdecode::advance_step` run the CUDA kernel on CUDA tensors (idempotent)."""
    global _registered
    if not _registered:
        load_library()
        advance_step.register_kernel("cuda")(_advance_step_cuda)
        _registered = True
