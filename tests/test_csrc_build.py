"""csrc/ compiles with nvcc and the library loads with ctypes on a machine without a GPU.

This is how CI catches a compile error in the CUDA sources (skipped only where nvcc
is absent). The library links the CUDA runtime statically and makes no CUDA call
until a kernel is launched, so it loads without a driver; the launcher validates
its arguments before any CUDA call, so a bad call is answered without a GPU. The same
library exports the host entry point (the kernels' per-row code in a host loop, which
tests/test_advance_step_host.py compares with the torch reference).
"""

from __future__ import annotations

import ctypes

import pytest

from graphdecode.compiled import cuda_kernels, kernel_build

CUDA_ERROR_INVALID_VALUE = 1


@pytest.fixture(scope="module")
def built_library(tmp_path_factory) -> str:
    if kernel_build.find_nvcc() is None:
        pytest.skip("nvcc not found")
    src = kernel_build.source_dir()
    assert src is not None, "csrc/ sources not found"
    out = tmp_path_factory.mktemp("kernels") / kernel_build.LIB_NAME
    return kernel_build.build(str(out), src)  # raises with nvcc's output on a compile error


def _launch(lib, num_rows: int, max_pages: int, page_size: int, table_stride: int) -> int:
    null = None
    return lib.graphdecode_advance_step(
        null, null, null, table_stride, null, null, null, null, null, null, null,
        num_rows, max_pages, page_size, 1, null,
    )


def test_library_loads_and_reports_its_abi(built_library):
    lib = cuda_kernels.open_library(built_library)
    assert lib.graphdecode_kernels_abi_version() == cuda_kernels.ABI_VERSION == 2
    assert lib.graphdecode_advance_step_host.argtypes == cuda_kernels._HOST_ARGTYPES
    assert lib.graphdecode_advance_step.argtypes == cuda_kernels._LAUNCHER_ARGTYPES


@pytest.mark.parametrize(
    "num_rows, max_pages, page_size, table_stride",
    [(0, 4, 16, 4), (1025, 4, 16, 4), (2, 0, 16, 4), (2, 4, 0, 4), (2, 4, 16, 3)],
)
def test_launcher_rejects_bad_arguments_without_touching_a_gpu(built_library, num_rows, max_pages, page_size,
                                                               table_stride):
    lib = cuda_kernels.open_library(built_library)
    assert _launch(lib, num_rows, max_pages, page_size, table_stride) == CUDA_ERROR_INVALID_VALUE
    if num_rows <= 1024:  # the host entry point has no row limit; the other checks are the same
        null = None
        err = lib.graphdecode_advance_step_host(null, null, null, table_stride, null, null, null, null, null, null,
                                                null, num_rows, max_pages, page_size, 1)
        assert err == CUDA_ERROR_INVALID_VALUE


def test_build_stamp_tracks_the_sources(built_library):
    src = kernel_build.source_dir()
    assert kernel_build.is_current(built_library, src)
    with open(built_library + ".sha256") as f:
        assert f.read().strip() == kernel_build.source_hash(src)


def test_exported_symbols_are_plain_c(built_library):
    lib = ctypes.CDLL(built_library)
    for name in ("graphdecode_advance_step", "graphdecode_advance_step_host", "graphdecode_kernels_abi_version"):
        assert hasattr(lib, name)  # extern "C": unmangled
