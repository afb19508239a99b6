"""Keep freed host memory in the process, so CPU windows do not page-fault every step.

An eager CPU window allocates and frees tens of MB per layer (the attention's gathered
K/V pages, activations for 256 rows). glibc's malloc hands large blocks back to the
kernel when they are freed (munmap above its mmap threshold, or by trimming the top of
the heap), and the next window touches fresh pages again: in the engine-core process of
`graphdecode serve` that was 60,000-80,000 minor page faults and ~0.1 s of system time
per window, windows 2x slower than the same work in another process whose heap happened
to be laid out differently (profiling/bench_serve.py, BENCHMARKS.md section 9). PyTorch's
CPU allocator does not cache; its docs point at jemalloc/tcmalloc for this. We need no
preload: two mallopt settings make glibc keep what it freed (the same ones
MALLOC_TRIM_THRESHOLD_ / MALLOC_MMAP_THRESHOLD_ set from the environment).

The cost is that the process keeps its peak host memory (up to 1 GiB of trimmable heap)
instead of returning it; blocks of 32 MiB and more are still mapped and unmapped.
A no-op off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30  # keep up to 1 GiB of free heap top
MMAP_THRESHOLD = 32 << 20  # glibc's largest: blocks below it come from the heap, and stay


def _libc():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


def keep_freed_host_memory(libc=None) -> bool:
    """Apply the settings (process-wide, idempotent); True if glibc took both."""
    libc = libc if libc is not None else _libc()
    if libc is None:
        return False
    ok = bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if not ok:
        log.debug("mallopt refused the host-memory settings; CPU windows may page-fault")
    return ok
