"""Loads csrc's CUDA library with ctypes; `advance_step_cuda` launches its advance_step kernel
(device/advance_step.py registers it as the CUDA kernel of `graphdecode::advance_step`,
whose CPU/meta implementation is the torch reference).

Search order: the library setup.py built into the package (if it matches the
sources), else one built at first use with nvcc into the cache directory
($GRAPHDECODE_CACHE, default ~/.cache/graphdecode), for this GPU's architecture.

`open_host_library` also serves the host entry point that runs the kernels' per-row
code on CPU tensors (`advance_step_host.py`, what the CPU tests check).

`available()` says whether the library can be had (built or loaded); when it cannot (no
nvcc and nothing prebuilt) it warns once, and the op keeps its torch reference, which is
slower but computes the same values and is just as capturable.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings

import torch

from ..cache import cache_root
from . import build as kernel_build

ABI_VERSION = 2
_P = ctypes.c_void_p
_HOST_ARGTYPES = [
    _P, _P, _P, ctypes.c_int64,  # sampled, done, block_table, table_stride
    _P, _P, _P, _P,  # input_ids, positions, seq_lens, slot_mapping
    _P, _P, _P,  # kv_indptr, kv_indices, kv_last_page_len
    ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,  # num_rows, max_pages, page_size, advance
]
_LAUNCHER_ARGTYPES = [*_HOST_ARGTYPES, _P]  # + cudaStream_t


def library_path() -> str:
    """The packaged library if current, else a cached build for this GPU (building it if missing)."""
    src = kernel_build.source_dir()
    packaged = os.path.join(kernel_build.package_dir(), "_kernels", kernel_build.LIB_NAME)
    if kernel_build.is_current(packaged, src):
        return packaged
    if src is None:
        raise RuntimeError("graphdecode's CUDA library is missing and csrc/ sources are not available")
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    arch = "".join(map(str, capability)) if capability else "default"
    path = os.path.join(cache_root(), "kernels", f"{kernel_build.source_hash(src)}-sm{arch}", kernel_build.LIB_NAME)
    if not os.path.isfile(path):
        kernel_build.build(path, src, kernel_build.arch_flags_for(capability))
    return path


def open_host_library(path: str) -> ctypes.CDLL:
    """dlopen a library built from csrc/ (by nvcc, or the C++-only `kernel_build.build_host`),
    check its ABI and declare the host entry point `graphdecode_advance_step_host`."""
    lib = ctypes.CDLL(path)
    lib.graphdecode_kernels_abi_version.restype = ctypes.c_int
    lib.graphdecode_kernels_abi_version.argtypes = []
    if lib.graphdecode_kernels_abi_version() != ABI_VERSION:
        raise RuntimeError(f"{path}: unexpected ABI version; rebuild csrc/")
    lib.graphdecode_advance_step_host.restype = ctypes.c_int
    lib.graphdecode_advance_step_host.argtypes = _HOST_ARGTYPES
    return lib


def open_library(path: str) -> ctypes.CDLL:
    """dlopen the nvcc-built library and declare its C signatures (no CUDA call is made)."""
    lib = open_host_library(path)
    try:
        launcher = lib.graphdecode_advance_step
    except AttributeError as exc:  # the C++-only build has no kernels
        raise RuntimeError(f"{path}: no CUDA launcher in this library (not an nvcc build?)") from exc
    launcher.restype = ctypes.c_int
    launcher.argtypes = _LAUNCHER_ARGTYPES
    return lib


@functools.cache
def load_library() -> ctypes.CDLL:
    return open_library(library_path())


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(f"advance_step: {name} must be a contiguous {dtype} tensor on {device}")


def check_buffers(sampled, done, block_table, input_ids, positions, seq_lens, slot_mapping,
                  kv_indptr, kv_indices, kv_last_page_len, device: torch.device) -> tuple[int, int]:
    """What the C entry points need of their tensors (dtypes, contiguity, sizes); returns (B, max_pages)."""
    rows, max_pages = block_table.shape
    if block_table.dtype != torch.int32 or block_table.stride(1) != 1:
        raise ValueError("advance_step: block_table must be int32 with unit column stride")
    for name, t, dtype in (
        ("sampled", sampled, torch.int64), ("done", done, torch.bool), ("input_ids", input_ids, torch.int64),
        ("positions", positions, torch.int64), ("seq_lens", seq_lens, torch.int32),
        ("slot_mapping", slot_mapping, torch.int64), ("kv_indptr", kv_indptr, torch.int32),
        ("kv_indices", kv_indices, torch.int32), ("kv_last_page_len", kv_last_page_len, torch.int32),
    ):
        _check(name, t, dtype, device)
    if kv_indptr.numel() != rows + 1 or kv_indices.numel() != rows * max_pages:
        raise ValueError("advance_step: kv_indptr must hold B + 1 and kv_indices B * max_pages entries")
    return rows, max_pages


def advance_step_cuda(sampled, done, block_table, input_ids, positions, seq_lens, slot_mapping,
                       kv_indptr, kv_indices, kv_last_page_len, page_size, advance) -> None:
    device = block_table.device
    rows, max_pages = check_buffers(sampled, done, block_table, input_ids, positions, seq_lens, slot_mapping,
                                    kv_indptr, kv_indices, kv_last_page_len, device)
    err = load_library().graphdecode_advance_step(
        sampled.data_ptr(), done.data_ptr(), block_table.data_ptr(), block_table.stride(0),
        input_ids.data_ptr(), positions.data_ptr(), seq_lens.data_ptr(), slot_mapping.data_ptr(),
        kv_indptr.data_ptr(), kv_indices.data_ptr(), kv_last_page_len.data_ptr(),
        rows, max_pages, page_size, int(advance), torch.cuda.current_stream(device).cuda_stream,
    )
    if err != 0:
        raise RuntimeError(f"graphdecode_advance_step failed with CUDA error {err}")


@functools.cache
def available() -> bool:
    """Whether the CUDA library can be built or loaded (a warning, once, when it cannot)."""
    try:
        load_library()
    except (RuntimeError, OSError) as exc:
        warnings.warn(f"graphdecode: CUDA advance_step unavailable, using the torch reference on CUDA: {exc}")
        return False
    return True
