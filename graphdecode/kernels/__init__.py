"""The hand-written kernels and their build: what must be fast or no library does.

* build.py: compiles csrc/ (nvcc for CUDA, the system C++ compiler for the CPU kernels), at
  install time (setup.py loads it on its own, without torch) or at first use into the cache;
* cpu.py: the CPU library (paged attention decode / verify, fused norm and rotary passes, the
  panel linear, the token-mask and automaton-advance passes), loaded with ctypes;
* cuda.py: the CUDA library (advance_step), registered as the CUDA kernel of its torch op;
* advance_step_host.py: the CUDA file's host entry point built with the C++ compiler, so CPU
  tests run the same code the GPU runs;
* ptxas.py: what ptxas reports about the CUDA kernels (registers, spills) and whether their
  launches fit an SM.
"""
