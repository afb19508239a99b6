"""Page allocator with reference counts.

Pages are shared by reference count (n > 1 children share their prompt's full
pages); a page returns to the free list when its last holder frees it. Page 0 is the
scratch page and is never handed out. All operations cost O(pages touched).
"""

from __future__ import annotations

from ..attention.kv_cache import SCRATCH_PAGE


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._refcount = [0] * num_pages
        self._refcount[SCRATCH_PAGE] = 1  # held forever
        self._free = [p for p in range(num_pages - 1, 0, -1)]  # pop() hands out low pages first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"out of KV pages: asked for {count}, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        for p in pages:
            self._refcount[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)
            elif self._refcount[p] < 0:
                raise RuntimeError(f"page {p} freed more often than held")

    def refcount(self, page: int) -> int:
        return self._refcount[page]
