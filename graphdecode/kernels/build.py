"""Building csrc/: shared by setup.py (install time) and the loaders (first use).

No torch import here: setup.py loads this file on its own, in a build environment
that may have no torch. The library is plain CUDA with an extern "C" ABI, linked
against the static CUDA runtime, so it loads without torch headers or libcudart.

The sources also hold a host entry point (`graphdecode_advance_step_host`) that runs
the kernels' per-row code in a plain loop. It is in the nvcc library and, where nvcc
is absent, builds alone with the system C++ compiler (`build_host`): `host_library`
gives the tests one or the other, so CI checks the kernels' logic without a GPU.
`build_with_report` is the same nvcc build with ptxas's resource report (-Xptxas -v:
registers, spills, shared memory per kernel), which `ptxas_report` reads.

The CPU kernels (`CPU_SOURCES`: paged attention that reads the KV pages in place, the fused
RMSNorm / rotary passes of a decoder layer, the float32 linear for few rows over panelled weights, prefill
attention over the pages, a decode step's Llama layers in one call) are
plain C++ built with the system compiler for the machine they run on (`build_cpu`,
-march=native), at first use, into the cache (kernels/cpu.py).
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess

LIB_NAME = "libgraphdecode_kernels.so"
HOST_LIB_NAME = "libgraphdecode_kernels_host.so"  # C++ build: host entry point only, no kernels
SOURCES = ("advance_step.cu",)
CPU_LIB_NAME = "libgraphdecode_cpu.so"
CPU_SOURCES = ("cpu_attention.cpp", "cpu_fused.cpp", "cpu_linear.cpp", "cpu_prefill.cpp", "cpu_layers.cpp",
               "cpu_qlinear.cpp", "cpu_recurrent.cpp", "cpu_sampling.cpp")
CPU_HEADERS = ("cpu_common.h",)  # included by CPU_SOURCES: hashed and shipped with them, not compiled alone
# -fopenmp: `omp parallel` loops run on torch's OpenMP pool (the library binds to the libgomp.so.1
# torch loaded); where the compiler has no OpenMP, -fopenmp-simd (the `omp simd` loops still
# vectorise, the kernels run on one thread). -fno-math-errno: tanh/floor need no errno, so they vectorise
OPENMP_FLAGS = ("-fopenmp", "-fopenmp-simd")
CPU_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-std=c++17", "-shared", "-fPIC", "-Wall")
PTXAS_REPORT_FLAGS = ("-Xptxas", "-v")  # ptxas prints each kernel's registers, spills and shared memory
DEFAULT_ARCH_FLAGS = (
    "-gencode", "arch=compute_90,code=sm_90",
    "-gencode", "arch=compute_90,code=compute_90",  # embedded PTX for newer GPUs
)


def package_dir() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_dir(sources: tuple[str, ...] = SOURCES) -> str | None:
    """csrc/ of a source checkout, or the copy setup.py puts into the package."""
    for candidate in (os.path.join(os.path.dirname(package_dir()), "csrc"), os.path.join(package_dir(), "_csrc")):
        if all(os.path.isfile(os.path.join(candidate, s)) for s in sources):
            return candidate
    return None


def source_hash(src_dir: str, sources: tuple[str, ...] = SOURCES) -> str:
    digest = hashlib.sha256()
    for name in sources:
        with open(os.path.join(src_dir, name), "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()[:16]


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = os.path.join(home, "bin", "nvcc")
    return candidate if os.path.isfile(candidate) else None


def find_cxx() -> str | None:
    """The system C++ compiler: $CXX, else g++, else c++."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        found = shutil.which(name) if name else None
        if found:
            return found
    return None


def arch_flags_for(capability: tuple[int, int] | None) -> tuple[str, ...]:
    env = os.environ.get("GRAPHDECODE_CUDA_ARCH_FLAGS")
    if env:
        return tuple(env.split())
    if capability is None:
        return DEFAULT_ARCH_FLAGS
    cc = f"{capability[0]}{capability[1]}"
    return ("-gencode", f"arch=compute_{cc},code=sm_{cc}", "-gencode", f"arch=compute_{cc},code=compute_{cc}")


def build(out_path: str, src_dir: str, arch_flags=DEFAULT_ARCH_FLAGS, nvcc: str | None = None) -> str:
    """Compile the sources into out_path (atomically); writes a .sha256 stamp beside it."""
    return _nvcc_build(out_path, src_dir, arch_flags, nvcc, ())[0]


def build_with_report(out_path: str, src_dir: str, arch_flags=DEFAULT_ARCH_FLAGS,
                      nvcc: str | None = None) -> tuple[str, str]:
    """build() with ptxas's resource report (`-Xptxas -v`; the same library): returns
    (out_path, nvcc's output), whose `ptxas info` lines give each kernel's registers,
    spills and shared memory per architecture (`ptxas_report.parse` reads them)."""
    return _nvcc_build(out_path, src_dir, arch_flags, nvcc, PTXAS_REPORT_FLAGS)


def _nvcc_build(out_path: str, src_dir: str, arch_flags, nvcc: str | None, extra_flags) -> tuple[str, str]:
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    tmp = f"{out_path}.{os.getpid()}.tmp"
    cmd = [
        nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-cudart", "static",
        *arch_flags, *extra_flags, "-o", tmp, *(os.path.join(src_dir, s) for s in SOURCES),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{result.stdout}\n{result.stderr}")
    os.replace(tmp, out_path)
    with open(out_path + ".sha256", "w") as f:
        f.write(source_hash(src_dir))
    return out_path, result.stdout + result.stderr


def build_host(out_path: str, src_dir: str, cxx: str | None = None) -> str:
    """Compile the sources as plain C++ (no kernels, no CUDA) into out_path, atomically.

    The result exports only the host entry point and the ABI version. It gets no .sha256
    stamp: `is_current` must never take it for the CUDA library.
    """
    cxx = cxx or find_cxx()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or put g++ on PATH)")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    tmp = f"{out_path}.{os.getpid()}.tmp"
    cmd = [
        cxx, "-O2", "-std=c++17", "-shared", "-fPIC", "-Wall", "-o", tmp,
        "-x", "c++", *(os.path.join(src_dir, s) for s in SOURCES),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{os.path.basename(cxx)} failed ({' '.join(cmd)}):\n{result.stdout}\n{result.stderr}")
    os.replace(tmp, out_path)
    return out_path


def cpu_tag() -> str:
    """This CPU's model and instruction-set flags: a -march=native build is only for such a CPU."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            text += "".join(line for line in f if line.startswith(("model name", "flags")))[:8192]
    except OSError:
        text += platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cpu_library_key(src_dir: str) -> str:
    """The folder name of the CPU kernels built from these sources for this CPU."""
    return f"{source_hash(src_dir, CPU_SOURCES + CPU_HEADERS)}-cpu-{cpu_tag()}"


def build_cpu(out_path: str, src_dir: str, cxx: str | None = None) -> str:
    """Compile the CPU kernels for this machine into out_path, atomically."""
    cxx = cxx or find_cxx()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or put g++ on PATH)")
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    tmp = f"{out_path}.{os.getpid()}.tmp"
    for openmp in OPENMP_FLAGS:
        cmd = [cxx, *CPU_FLAGS, openmp, "-o", tmp, *(os.path.join(src_dir, s) for s in CPU_SOURCES)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode == 0:
            break
    else:
        raise RuntimeError(f"{os.path.basename(cxx)} failed ({' '.join(cmd)}):\n{result.stdout}\n{result.stderr}")
    os.replace(tmp, out_path)
    return out_path


def host_library(out_dir: str, src_dir: str) -> str:
    """A library whose host entry point runs on this machine, built into out_dir.

    The nvcc build (the very library the GPU loads) where nvcc exists, else the C++
    compiler's host-only build. Raises RuntimeError when neither compiler is around.
    """
    if find_nvcc() is not None:
        return build(os.path.join(out_dir, LIB_NAME), src_dir)
    if find_cxx() is not None:
        return build_host(os.path.join(out_dir, HOST_LIB_NAME), src_dir)
    raise RuntimeError("neither nvcc nor a C++ compiler found: cannot build the host entry point")


def is_current(lib_path: str, src_dir: str | None) -> bool:
    """A built library matches the sources (or no sources are around to say otherwise)."""
    if not os.path.isfile(lib_path):
        return False
    if src_dir is None:
        return True
    try:
        with open(lib_path + ".sha256") as f:
            return f.read().strip() == source_hash(src_dir)
    except OSError:
        return False
