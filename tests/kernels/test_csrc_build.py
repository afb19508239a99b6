"""csrc/ compiles with nvcc and the library loads with ctypes on a machine without a GPU.

This is how CI catches a compile error in the CUDA sources (skipped only where nvcc
is absent). The library links the CUDA runtime statically and makes no CUDA call
until a kernel is launched, so it loads without a driver; the launcher validates
its arguments before any CUDA call, so a bad call is answered without a GPU. The same
library exports the host entry point (the kernels' per-row code in a host loop, which
tests/kernels/test_advance_step_host.py compares with the torch reference).

The build asks ptxas for its resource report (-Xptxas -v): every launched kernel must fit an
SM at the block size it is launched with (advance_rows_kernel: 1024 threads, so at most 64
registers a thread, which its __launch_bounds__ guarantees). The report's parser is checked
on nvcc 13.0's own output, so it runs where nvcc is absent too.
"""

from __future__ import annotations

import ctypes

import pytest

from graphdecode.kernels import build as kernel_build
from graphdecode.kernels import cuda as cuda_kernels
from graphdecode.kernels import ptxas as ptxas_report

CUDA_ERROR_INVALID_VALUE = 1

# nvcc 13.0's -Xptxas -v output for csrc/advance_step.cu (sm_90), as the build stage reads it
CANNED_PTXAS = """\
ptxas info    : 28 bytes gmem
ptxas info    : Compiling entry function '_ZN48_GLOBAL__N__51afd492_15_advance_step_cu_8a396d2219fill_indices_kernelEPKbPKilS3_Piil' for 'sm_90'
ptxas info    : Function properties for _ZN48_GLOBAL__N__51afd492_15_advance_step_cu_8a396d2219fill_indices_kernelEPKbPKilS3_Piil
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 16 registers, used 0 barriers
ptxas info    : Compile time = 10.633 ms
ptxas info    : Compiling entry function '_ZN48_GLOBAL__N__51afd492_15_advance_step_cu_8a396d2219advance_rows_kernelEPKlPKbPKilPlS6_PiS6_S7_S7_iiii' for 'sm_90'
ptxas info    : Function properties for _ZN48_GLOBAL__N__51afd492_15_advance_step_cu_8a396d2219advance_rows_kernelEPKlPKbPKilPlS6_PiS6_S7_S7_iiii
    8 bytes stack frame, 12 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 47 registers, used 1 barriers, 4256 bytes smem
ptxas info    : Compile time = 16.273 ms
"""  # noqa: E501


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[str, str]:
    """(the library, nvcc's output with ptxas's resource report)."""
    if kernel_build.find_nvcc() is None:
        pytest.skip("nvcc not found")
    src = kernel_build.source_dir()
    assert src is not None, "csrc/ sources not found"
    out = tmp_path_factory.mktemp("kernels") / kernel_build.LIB_NAME
    return kernel_build.build_with_report(str(out), src)  # raises with nvcc's output on a compile error


@pytest.fixture(scope="module")
def built_library(built) -> str:
    return built[0]


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


def test_every_kernel_launch_fits_an_sm(built):
    usages = ptxas_report.parse(built[1])
    assert sorted((u.kernel, u.arch) for u in usages) == [("advance_rows_kernel", "sm_90"),
                                                          ("fill_indices_kernel", "sm_90")]
    rows = next(u for u in usages if u.kernel == "advance_rows_kernel")
    assert 0 < rows.registers <= 64 and rows.smem_bytes > 0  # 1024 threads; the BlockScan's storage
    assert ptxas_report.launch_problems(usages) == []


def test_ptxas_report_is_read_from_nvccs_output():
    fill, rows = ptxas_report.parse(CANNED_PTXAS)
    assert fill == ptxas_report.KernelUsage("fill_indices_kernel", "sm_90", registers=16)
    assert rows == ptxas_report.KernelUsage("advance_rows_kernel", "sm_90", registers=47, spill_stores=12,
                                            spill_loads=4, stack_bytes=8, smem_bytes=4256)
    assert rows.as_dict()["registers"] == 47
    assert ptxas_report.kernel_name("_Z6kernelPfi") == "kernel" and ptxas_report.kernel_name("plain_c") == "plain_c"
    assert ptxas_report.launch_problems([fill, rows]) == []


def test_a_block_that_needs_more_registers_than_an_sm_holds_is_a_problem():
    assert ptxas_report.block_registers(64, 1024) == 65536  # 64 a thread: exactly one SM's file
    assert ptxas_report.block_registers(65, 1024) == 73728  # per warp 65 * 32 rounds up to 2304
    assert ptxas_report.block_registers(47, 128) == 6144
    heavy = ptxas_report.KernelUsage("advance_rows_kernel", "sm_90", registers=72)
    light = ptxas_report.KernelUsage("fill_indices_kernel", "sm_90", registers=72)  # 128 threads: fits
    problems = ptxas_report.launch_problems([heavy, light])
    assert len(problems) == 1 and problems[0].startswith("advance_rows_kernel (sm_90): 72 registers x 1024 threads")
    missing = ptxas_report.launch_problems([light])
    assert missing == ["advance_rows_kernel: no ptxas report (not compiled, or nvcc ran without -Xptxas -v)"]
