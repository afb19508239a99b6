"""A CPU model's weights on 2 MiB pages (EngineConfig.cpu_huge_pages).

A CPU decode step streams every weight from memory, and on 4 KiB pages the loads miss the TLB all the way:
a 135M-parameter fp32 model is 130,000 pages, far beyond any TLB; on 2 MiB pages it is 260. Linux backs
anonymous memory with 2 MiB pages only where asked (`transparent_hugepage` is `madvise` on most
distributions); torch asks only under THP_MEM_ALLOC_ENABLE=1, which it reads once, at the process's first
allocation (too late for a library to set, and it would change every allocation of the user's process). So
once a model is loaded, its weights' memory is collapsed in place (madvise MADV_COLLAPSE, Linux 6.1+): the
same addresses (the CPU kernels hold the panels'), the same contents, no extra memory. Only the 2 MiB pages
that lie inside the weights are collapsed, never one that reaches into memory beyond them (the ranges merge
across the few KiB of malloc headers between two weights); elsewhere (an older kernel, another OS) the weights
stay on the pages they have. The kernel copies about 0.5 GB/s, so the collapse runs in a thread beside the rest
of start-up (ctypes lets go of the GIL; the kernel keeps the memory consistent under concurrent readers, as it
does for khugepaged's collapses). BENCHMARKS.md 18u: SmolLM2-135M fp32 on 2 Zen 4 cores decodes 8% faster
at batch 1, 4-6% at batch 4, the same at 16 (more rows per weight read).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterable

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_COLLAPSE = 25  # <linux/mman.h>
_GAP = 64 << 10  # storages closer than this merge into one range: a malloc header and page rounding between


def libc_madvise() -> Callable[[int, int, int], int] | None:
    """madvise(addr, length, advice) from the C library, errno kept for ctypes.get_errno (None off Linux)."""
    name = ctypes.util.find_library("c") if sys.platform.startswith("linux") else None
    if name is None:
        return None
    fn = ctypes.CDLL(name, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """Every CPU tensor the model holds: parameters, buffers, and those of the objects its modules keep (a
    linear's panels, a quantized weight's blocks, the decode layers' tables)."""
    found: dict[int, torch.Tensor] = {}
    seen: set[int] = set()

    def visit(value, depth: int) -> None:
        if id(value) in seen or depth > 4:
            return
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.device.type == "cpu" and value.layout == torch.strided:
                found[id(value)] = value
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item, depth + 1)
        elif (not isinstance(value, torch.nn.Module) and hasattr(value, "__dict__")
              and type(value).__module__.startswith("graphdecode.")):
            for item in vars(value).values():
                visit(item, depth + 1)

    for module in model.modules():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            visit(tensor, 0)
        for name, item in vars(module).items():
            if not name.startswith("_"):
                visit(item, 0)
    return list(found.values())


def merged_ranges(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The address ranges [start, end) of these tensors' storages, sorted, those less than _GAP apart merged."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t.numel()}
    merged: list[tuple[int, int]] = []
    for start, size in sorted(storages.items()):
        if merged and start - merged[-1][1] <= _GAP:
            merged[-1] = (merged[-1][0], max(merged[-1][1], start + size))
        else:
            merged.append((start, start + size))
    return merged


def inner_pages(ranges: Iterable[tuple[int, int]]) -> list[int]:
    """The addresses of the 2 MiB pages that lie wholly inside these ranges."""
    return [page for start, end in ranges
            for page in range(-(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE, HUGE_PAGE)]


def collapse_pages(pages: Iterable[int], madvise) -> int:
    """MADV_COLLAPSE each page; the bytes collapsed. A page the kernel refuses (EAGAIN: busy; ENOMEM: not
    mapped, or no free huge page) is left as it is; EINVAL (no MADV_COLLAPSE in this kernel) ends the walk."""
    done = 0
    for page in pages:
        if madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
            done += HUGE_PAGE
        elif ctypes.get_errno() == errno.EINVAL:
            break
    return done


class HugePages:
    """The collapse of one model's weights, in a thread from construction; `wait()` joins it."""

    def __init__(self, model: torch.nn.Module, name: str = "model", madvise=None):
        self.name = name
        self.pages = inner_pages(merged_ranges(model_tensors(model)))
        self.bytes = 0  # collapsed so far (final once the thread ends)
        self._madvise = madvise if madvise is not None else libc_madvise()
        self._thread = None
        if self._madvise is not None and self.pages:
            self._thread = threading.Thread(target=self._run, name="graphdecode-huge-pages", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        self.bytes = collapse_pages(self.pages, self._madvise)
        log.debug("%s: %d of %d MiB of weights on 2 MiB pages in %.2f s", self.name, self.bytes >> 20,
                  len(self.pages) * HUGE_PAGE >> 20, time.perf_counter() - start)

    def wait(self) -> int:
        """The bytes collapsed, once the thread ends."""
        if self._thread is not None:
            self._thread.join()
        return self.bytes
