"""Packaging: builds csrc/ with nvcc where nvcc exists; never fails an install where it does not."""

import importlib.util
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def _kernel_build():
    path = os.path.join(HERE, "graphdecode", "kernels", "build.py")
    spec = importlib.util.spec_from_file_location("graphdecode_kernel_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        kb = _kernel_build()
        src = os.path.join(HERE, "csrc")
        editable = getattr(self, "editable_mode", False)
        package_root = os.path.join(HERE if editable else self.build_lib, "graphdecode")
        if not editable:  # ship the sources so a first-use build can find them
            os.makedirs(os.path.join(package_root, "_csrc"), exist_ok=True)
            for name in kb.SOURCES + kb.CPU_SOURCES + kb.CPU_HEADERS:
                shutil.copy(os.path.join(src, name), os.path.join(package_root, "_csrc", name))
        if kb.find_cxx() is not None:  # the CPU kernels, for the CPU installing (else: at first use)
            try:
                kb.build_cpu(os.path.join(package_root, "_kernels", kb.cpu_library_key(src), kb.CPU_LIB_NAME), src)
                print("graphdecode: built the CPU attention kernels")
            except Exception as exc:  # an install must not fail because the C++ compiler did
                print(f"graphdecode: warning: building the CPU kernels failed, they will be built at first use:\n{exc}")
        if kb.find_nvcc() is None:
            print("graphdecode: nvcc not found, CUDA kernels will be built at first use on a GPU")
            return
        try:
            kb.build(os.path.join(package_root, "_kernels", kb.LIB_NAME), src)
            print("graphdecode: built CUDA kernels with nvcc")
        except Exception as exc:  # an install must not fail because nvcc did
            print(f"graphdecode: warning: building CUDA kernels failed, they will be built at first use:\n{exc}")


setup(cmdclass={"build_py": BuildPyWithKernels})
